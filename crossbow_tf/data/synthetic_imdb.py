"""An offline token task in keras.datasets.imdb's format, deterministic from a seed (no download).

``load_synthetic_imdb`` returns what ``keras.datasets.imdb.load_data`` returns: ((x_train, y_train),
(x_test, y_test)), each x an object array of Python lists of word ids, each y int64 labels 0/1.
The conventions are IMDB's: 1 starts every review, 2 is a word outside ``num_words``, and a word
of frequency rank r (1 = the most frequent) has id r + index_from (index_from=3). Words are drawn
from a Zipf-like distribution over the vocabulary; each review also carries a few sentiment words
(ranks 20-69 positive, 70-119 negative, inside any num_words >= 123) and its label says which kind
it holds more of, so a bag-of-words model can learn the rule and a model that cannot read stays
at chance (0.5).
"""
import numpy as np

VOCABULARY = 20000
POSITIVE = np.arange(20, 70)
NEGATIVE = np.arange(70, 120)


def _review(rng, label, length):
    ranks = np.minimum(rng.zipf(1.3, size=length), VOCABULARY - 1)
    # Only planted words carry sentiment: a neutral draw of a sentiment rank moves past them.
    sentiment = (ranks >= POSITIVE[0]) & (ranks <= NEGATIVE[-1])
    ranks[sentiment] += NEGATIVE[-1] + 1 - POSITIVE[0]
    own, other = (POSITIVE, NEGATIVE) if label else (NEGATIVE, POSITIVE)
    planted = max(2, length // 8)
    places = rng.choice(length, size=planted + planted // 2, replace=False)
    ranks[places[:planted]] = rng.choice(own, size=planted)
    ranks[places[planted:]] = rng.choice(other, size=len(places) - planted)
    return ranks


def _split(rng, count, lengths, num_words, maxlen, index_from):
    labels = rng.integers(0, 2, size=count)
    reviews = []
    for label in labels:
        ids = _review(rng, label, int(rng.integers(*lengths))) + index_from
        if num_words is not None:
            ids = np.where(ids < num_words, ids, 2)
        review = [1] + ids.tolist()
        reviews.append(review if maxlen is None else review[:maxlen])
    x = np.empty(count, dtype=object)
    x[:] = reviews
    return x, labels.astype(np.int64)


def load_synthetic_imdb(num_words=None, maxlen=None, seed=0, train_size=2000, test_size=1000,
                        lengths=(30, 200), index_from=3):
    """keras.datasets.imdb.load_data's ((x_train, y_train), (x_test, y_test)) for the synthetic task.

    NUM_WORDS: ids of words ranked beyond it become 2 (oov); MAXLEN: reviews cut to that many ids;
    LENGTHS: the range of words per review (before the start id)."""
    if num_words is not None and num_words < NEGATIVE[-1] + index_from + 1:
        raise ValueError(f"load_synthetic_imdb: num_words={num_words} leaves out the sentiment words "
                         f"(ranks {POSITIVE[0]}-{NEGATIVE[-1]}); give at least {NEGATIVE[-1] + index_from + 1}")
    rng = np.random.default_rng(seed)
    train = _split(rng, train_size, lengths, num_words, maxlen, index_from)
    test = _split(rng, test_size, lengths, num_words, maxlen, index_from)
    return train, test
