"""``tfdist_digits``: an MNIST-shaped TFDS dataset built locally, offline.

The examples' default dataset. It is a real `tfds.core.GeneratorBasedBuilder`,
so it goes through the same TFDS code as ``mnist`` (``tfds.builder``,
``download_and_prepare``, sharded TFRecord files, ``tfds.ReadConfig``), but it
downloads nothing: every image is drawn from its split and index.

Each image is a seven-segment digit (28x28x1 ``uint8``) with a random shift,
stroke brightness and thickness plus Gaussian noise, so a small CNN learns it
to well above chance in an epoch or two, and no two examples are identical.

The workers of a cluster may call `prepare` on the same ``data_dir`` at once:
the chief builds, behind a lock, and the others wait for it, with a bound,
then read its files (`tfdist.data.prepare`).
"""

from __future__ import annotations

import os

from etils import epath
import numpy as np
import tensorflow_datasets as tfds

from tfdist.data import prepare as prepare_lib

__all__ = ["DIGITS_NAME", "DIGITS_SPLITS", "DIGITS_NUM_SHARDS", "TfdistDigits",
           "default_data_dir", "prepare_digits", "render_digit"]

#: The TFDS name of the builder below.
DIGITS_NAME = "tfdist_digits"
#: Examples per split.
DIGITS_SPLITS = {"train": 4096, "test": 1024}
#: Files per split: a cluster of up to this many workers shards by file.
DIGITS_NUM_SHARDS = 4

_SIZE = 28
# Seven segments as (row0, col0, row1, col1) boxes of a 20x12 glyph before the
# thickness is applied: top, upper-left, upper-right, middle, lower-left,
# lower-right, bottom.
_SEGMENTS = (
    (0, 0, 0, 11), (0, 0, 9, 0), (0, 11, 9, 11), (9, 0, 9, 11),
    (9, 0, 19, 0), (9, 11, 19, 11), (19, 0, 19, 11))
_DIGIT_SEGMENTS = (
    (0, 1, 2, 4, 5, 6), (2, 5), (0, 2, 3, 4, 6), (0, 2, 3, 5, 6),
    (1, 2, 3, 5), (0, 1, 3, 5, 6), (0, 1, 3, 4, 5, 6), (0, 2, 5),
    (0, 1, 2, 3, 4, 5, 6), (0, 1, 2, 3, 5, 6))
_SPLIT_SEEDS = {"train": 1, "test": 2}


def render_digit(label: int, rng: np.random.Generator) -> np.ndarray:
  """Draws one noisy seven-segment digit.

  Args:
    label: the digit, 0 to 9.
    rng: the source of the shift, brightness, thickness and noise.

  Returns:
    A ``(28, 28, 1)`` ``uint8`` image.
  """
  image = np.zeros((_SIZE, _SIZE), np.float32)
  top = 4 + int(rng.integers(-3, 4))
  left = 8 + int(rng.integers(-4, 5))
  thickness = int(rng.integers(2, 4))
  for segment in _DIGIT_SEGMENTS[label]:
    r0, c0, r1, c1 = _SEGMENTS[segment]
    brightness = rng.uniform(150, 255)
    image[top + r0:top + r1 + thickness, left + c0:left + c1 + thickness] = (
        brightness)
  image += rng.normal(0.0, 40.0, image.shape)
  return np.clip(image, 0, 255).astype(np.uint8)[..., None]


class TfdistDigits(tfds.core.GeneratorBasedBuilder):
  """MNIST-shaped seven-segment digits, generated offline."""

  VERSION = tfds.core.Version("1.0.0")
  RELEASE_NOTES = {"1.0.0": "Seven-segment digits with shift and noise."}

  # TFDS 4.9.10 derives this with `importlib_resources`, which it does not
  # declare as a dependency on Python >= 3.9 (tensorflow/datasets#11212); the
  # answer is the same file either way.
  @tfds.core.utils.classproperty
  @classmethod
  def code_path(cls) -> epath.Path:  # pylint: disable=no-self-argument
    return epath.Path(__file__)

  def _info(self) -> tfds.core.DatasetInfo:
    return self.dataset_info_from_configs(
        description=("Seven-segment digits 0-9 drawn offline with a random "
                     "shift, brightness, thickness and Gaussian noise; "
                     "MNIST's features and shapes."),
        features=tfds.features.FeaturesDict({
            # A raw uint8 tensor rather than `Image`: same shape and dtype as
            # MNIST's image, without a PNG encode per example (a build takes
            # seconds, not tens of seconds, on a loaded 2-core machine).
            "image": tfds.features.Tensor(shape=(_SIZE, _SIZE, 1),
                                          dtype=np.uint8),
            "label": tfds.features.ClassLabel(num_classes=10),
        }),
        supervised_keys=("image", "label"),
    )

  def _split_generators(self, dl_manager):
    del dl_manager  # Nothing to download.
    return {split: self._generate_examples(split, size)
            for split, size in DIGITS_SPLITS.items()}

  def _generate_examples(self, split: str, size: int):
    for index in range(size):
      rng = np.random.default_rng((_SPLIT_SEEDS[split], index))
      label = index % 10
      yield index, {"image": render_digit(label, rng), "label": label}


def default_data_dir() -> str:
  """Where `prepare` builds when no ``data_dir`` is given: TFDS's default.

  ``$TFDS_DATA_DIR`` when set, else ``~/tensorflow_datasets``, so that
  ``tfds.load("tfdist_digits")`` finds the build once this module is
  imported.
  """
  return os.environ.get("TFDS_DATA_DIR") or os.path.expanduser(
      "~/tensorflow_datasets")


def prepare_digits(data_dir: str | os.PathLike[str] | None = None, *,
                   lock_timeout_s: float = 300.0,
                   chief: bool | None = None) -> TfdistDigits:
  """Builds ``tfdist_digits`` into ``data_dir`` once; later calls reuse it.

  Safe to call from every worker at once: the chief builds, behind a lock
  file in ``data_dir``, and the others wait for it (`tfdist.data.prepare`).

  Args:
    data_dir: the TFDS data directory; `default_data_dir()` when omitted.
    lock_timeout_s: the longest wait, for the lock or for the chief.
    chief: whether this process builds; the resolved cluster's chief by
      default.

  Returns:
    The prepared builder.

  Raises:
    ConfigError: the wait outlived ``lock_timeout_s``, or the chief's build
      failed.
  """
  data_dir = os.fspath(data_dir) if data_dir else default_data_dir()
  return prepare_lib.prepared(
      lambda: TfdistDigits(data_dir=data_dir),
      lambda builder: builder.download_and_prepare(
          download_config=tfds.download.DownloadConfig(
              num_shards=DIGITS_NUM_SHARDS, try_download_gcs=False)),
      name=DIGITS_NAME, data_dir=data_dir, chief=chief,
      timeout_s=lock_timeout_s)
