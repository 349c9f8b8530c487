"""python tools/portable_results.py [STUDY ...]: rewrites committed study folders so that they name
no folder of the machine that wrote them, then regenerates their reports.

Older harness versions recorded absolute paths: the interpreter (/work/venv/bin/python) in every
run's log, the study's folder (/work/study/docs/results/X/...) in commands, logs, machine.json and
every run's JSON (config.checkpoint.dir, config.tensorboard), the bench's script in its .cmd files,
and Python's warnings name their site-packages file. The harness now records them relative to the
folder it ran in (crossbow_tf.files.recorded_path); this tool gives old study folders that form:

- an interpreter is ``python``; a file under site-packages is ``site-packages/...``;
- a path into the checkout the study ran in (.../docs/, .../tools/, .../configs/ ...) is relative
  to the checkout's root, the folder the study's command ran in;
- any other absolute path is left alone and named, and the tool exits 1.

A study folder of crossbow-reproduce (machine.json beside report.md) then has its report.md and
summary.json regenerated from its files by ``crossbow-reproduce --config C --out COPY --resume
--phases report`` in a temporary copy (C: the --config of machine.json's command), so its plots and
runs stay as they are. The regenerated report must equal the old one with its paths rewritten,
except the date it was written (then the rewritten files are kept as they are); other differences
are printed and refused unless --allow-report-changes writes the regenerated report and summary
(a report whose wording changed since it was written).

Run from the checkout's root: PYTHONPATH=. python tools/portable_results.py (every folder under
docs/results), or name the study folders.
"""
import argparse
import difflib
import json
import os
import re
import shlex
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # the checkout

# An absolute POSIX path: a "/" not inside a word, a relative path or a URL's "//", then at least
# one folder. "/device:CPU:0" and "(max-min)/median" are not paths.
ABSOLUTE = re.compile(r"(?<![\w./:~-])/(?:[\w.+@-]+/)+[\w.+@-]*")
INTERPRETER = re.compile(r"/bin/python[\d.]*$")
CHECKOUT_FOLDERS = ("docs", "tools", "configs", "crossbow_tf", "baselines", "examples", "tests")
TEXT_SUFFIXES = (".json", ".log", ".cmd", ".md", ".txt", ".csv")
WRITTEN_LINE = re.compile(r"^- started: .*; report written .*$")


def portable(path):
    """PATH's portable form, or None when it has none (not an interpreter, site-packages, nor in a checkout)."""
    if INTERPRETER.search(path):
        return "python"
    if "/site-packages/" in path:
        return "site-packages/" + path.split("/site-packages/", 1)[1]
    parts = path.split("/")
    for i, part in enumerate(parts):
        if part in CHECKOUT_FOLDERS and i + 1 < len(parts):
            return "/".join(parts[i:])
    return None


def rewrite(text):
    """(TEXT with every absolute path in its portable form, [absolute paths left as they were])."""
    left = []

    def one(match):
        new = portable(match.group(0))
        if new is None:
            left.append(match.group(0))
            return match.group(0)
        return new
    return ABSOLUTE.sub(one, text), left


def rewrite_folder(folder):
    """Rewrites every text file under FOLDER in place; returns (files changed, [(file, path left)])."""
    changed, left = 0, []
    for root, _, names in os.walk(folder):
        for name in sorted(names):
            path = os.path.join(root, name)
            if not name.endswith(TEXT_SUFFIXES):
                continue   # config.yaml is the user's config file, copied; PNGs and TensorBoard events hold no paths
            with open(path, encoding="utf-8") as f:
                text = f.read()
            new, unknown = rewrite(text)
            left += [(path, u) for u in unknown]
            if new != text:
                if name.endswith(".json"):
                    json.loads(new)   # still JSON: only path characters were replaced
                with open(path, "w", encoding="utf-8") as f:
                    f.write(new)
                changed += 1
    return changed, left


def study_config(folder):
    """The --config of the command in FOLDER/machine.json (a crossbow-reproduce study), else None."""
    machine = os.path.join(folder, "machine.json")
    if not (os.path.exists(machine) and os.path.exists(os.path.join(folder, "report.md"))):
        return None
    with open(machine) as f:
        words = shlex.split(json.load(f).get("command") or "")
    return words[words.index("--config") + 1] if "--config" in words else None


def regenerate(folder, config):
    """(report.md, summary.json text) rebuilt from a temporary copy of FOLDER by crossbow-reproduce's
    report phase."""
    from crossbow_tf.compare import reproduce
    with tempfile.TemporaryDirectory() as tmp:
        copy = os.path.join(tmp, os.path.basename(os.path.normpath(folder)))
        shutil.copytree(folder, copy)
        code = reproduce.main(["--config", config, "--out", copy, "--resume", "--phases", "report"])
        if code != 0:
            raise SystemExit(f"portable_results: the report phase of {folder} exited {code}")
        with open(os.path.join(copy, "report.md")) as f, open(os.path.join(copy, "summary.json")) as g:
            return f.read(), g.read()


def report_changes(old, new):
    """The unified diff of two reports without the line that dates the report ([]: the same report)."""
    strip = [[line for line in text.splitlines() if not WRITTEN_LINE.match(line)] for text in (old, new)]
    return list(difflib.unified_diff(*strip, "before", "regenerated", lineterm="", n=0))


def summary_changes(old, new):
    old, new = json.loads(old), json.loads(new)
    return [key for key in sorted(set(old) | set(new)) if old.get(key) != new.get(key)]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("studies", nargs="*", help="study folders (default: every folder under docs/results)")
    p.add_argument("--allow-report-changes", action="store_true",
                   help="write a regenerated report that differs from the old one beyond its date (printed)")
    args = p.parse_args(argv)
    studies = args.studies or sorted(os.path.join("docs", "results", d) for d in os.listdir(os.path.join("docs", "results"))
                                     if os.path.isdir(os.path.join("docs", "results", d)))
    problems = 0
    for folder in studies:
        changed, left = rewrite_folder(folder)
        print(f"{folder}: {changed} file(s) rewritten")
        for path, unknown in left:
            print(f"  {path}: {unknown}: no portable form; left as it was")
        problems += len(left)
        config = study_config(folder)
        if config is None:
            continue
        with open(os.path.join(folder, "report.md")) as f, open(os.path.join(folder, "summary.json")) as g:
            old_report, old_summary = f.read(), g.read()
        report, summary = regenerate(folder, config)
        diff, keys = report_changes(old_report, report), summary_changes(old_summary, summary)
        if not (diff or keys):   # the files as rewritten above are what the report phase writes now
            print(f"{folder}: the report regenerated from its files is the same (but its date): kept as it is")
            continue
        print(f"{folder}: the regenerated report differs beyond its date:", *diff,
              *([f"summary.json keys: {', '.join(keys)}"] if keys else []), sep="\n  ")
        if not args.allow_report_changes:
            print(f"{folder}: report.md and summary.json left as they were (--allow-report-changes writes them)")
            problems += 1
            continue
        for name, text in (("report.md", report), ("summary.json", summary)):
            with open(os.path.join(folder, name), "w") as f:
                f.write(text)
        print(f"{folder}: report.md and summary.json regenerated (config {config})")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
