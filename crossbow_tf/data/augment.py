"""Per-example preparation of stored images: decode, augment, normalise.

Training maps take (image, label, seed) where SEED is a shape-(2,) int tensor: they draw their
randomness from stateless ops so that an epoch's augmentation is a function of (seed, epoch,
position) alone and does not depend on which parallel map call ran first. The pipeline supplies
the seeds (see pipeline.train_batches); such maps carry ``needs_seed = True``.
"""
import tensorflow as tf

# Per-channel mean and standard deviation of the training images, in [0, 1] units (the constants
# the CIFAR reference implementations use).
CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)
CIFAR100_MEAN = (0.5071, 0.4865, 0.4409)
CIFAR100_STD = (0.2673, 0.2564, 0.2762)
# ImageNet RGB statistics used by the torchvision and Keras references.
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)

IMAGENET_SIZE = 224
IMAGENET_RESIZE = 256          # eval: shorter side to 256, then the centre 224x224
CIFAR_PAD = 4


def needs_seed(fn):
    fn.needs_seed = True
    return fn


def normalize(image, mean, std):
    """uint8 or [0, 255] float image -> float32 (image/255 - mean) / std per channel."""
    image = tf.cast(image, tf.float32) / 255.0
    return (image - tf.constant(mean, tf.float32)) / tf.constant(std, tf.float32)


def cifar_maps(mean, std, pad=CIFAR_PAD):
    """(train_map, eval_map) for 32x32x3 uint8 images: pad-PAD random crop and horizontal flip
    for training, normalisation only for evaluation."""

    @needs_seed
    def train_map(image, label, seed):
        seeds = tf.random.experimental.stateless_split(seed, 2)
        size = tf.shape(image)
        # Zero padding happens before normalisation, as in the references (black border).
        padded = tf.pad(image, [[pad, pad], [pad, pad], [0, 0]])
        image = tf.image.stateless_random_crop(padded, size, seed=seeds[0])
        image = tf.image.stateless_random_flip_left_right(image, seed=seeds[1])
        return normalize(image, mean, std), label

    def eval_map(image, label):
        return normalize(image, mean, std), label

    return train_map, eval_map


def _decode_and_random_crop(encoded, seed, area=(0.08, 1.0), ratio=(3 / 4, 4 / 3)):
    """Inception-style random resized crop read straight from the JPEG: only the crop is decoded."""
    shape = tf.io.extract_jpeg_shape(encoded)
    begin, size, _ = tf.image.stateless_sample_distorted_bounding_box(
        shape, bounding_boxes=tf.constant([[[0.0, 0.0, 1.0, 1.0]]]), seed=seed,
        min_object_covered=0.0, aspect_ratio_range=ratio, area_range=area,
        max_attempts=10, use_image_if_no_bounding_boxes=True)
    y, x, _ = tf.unstack(begin)
    h, w, _ = tf.unstack(size)
    window = tf.stack([y, x, h, w])
    return tf.io.decode_and_crop_jpeg(encoded, window, channels=3)


def _resize_and_center_crop(image, size=IMAGENET_SIZE, resize=IMAGENET_RESIZE):
    shape = tf.shape(image)
    h, w = tf.cast(shape[0], tf.float32), tf.cast(shape[1], tf.float32)
    scale = resize / tf.minimum(h, w)
    new_h = tf.cast(tf.round(h * scale), tf.int32)
    new_w = tf.cast(tf.round(w * scale), tf.int32)
    image = tf.image.resize(image, [new_h, new_w], method="bilinear", antialias=True)
    top, left = (new_h - size) // 2, (new_w - size) // 2
    return tf.image.crop_to_bounding_box(image, top, left, size, size)


def imagenet_maps(size=IMAGENET_SIZE, mean=IMAGENET_MEAN, std=IMAGENET_STD):
    """(train_map, eval_map) for (JPEG bytes, label) examples.

    Training: random resized crop (8%-100% of the area, aspect 3/4-4/3) to SIZE and a horizontal
    flip. Evaluation: shorter side to 256 (scaled with SIZE), centre SIZE x SIZE crop.
    """
    resize = round(size * IMAGENET_RESIZE / IMAGENET_SIZE)

    def _normalize(image):
        image = (image / 255.0 - tf.constant(mean, tf.float32)) / tf.constant(std, tf.float32)
        return tf.ensure_shape(image, [size, size, 3])

    @needs_seed
    def train_map(encoded, label, seed):
        seeds = tf.random.experimental.stateless_split(seed, 2)
        image = _decode_and_random_crop(encoded, seeds[0])
        image = tf.image.resize(image, [size, size], method="bilinear", antialias=True)
        image = tf.image.stateless_random_flip_left_right(image, seed=seeds[1])
        return _normalize(image), label

    def eval_map(encoded, label):
        image = tf.io.decode_jpeg(encoded, channels=3)
        return _normalize(_resize_and_center_crop(image, size, resize)), label

    return train_map, eval_map
