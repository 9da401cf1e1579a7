"""tfdist.data: batch sizes, shard policies, TFDS input and distribution.

Everything is real except TPU hardware: ``tfdist_digits`` built into a
temporary directory by the real TFDS builder code, ``mnist`` through TFDS's
own ``tfds.testing.mock_data``, downloads from a real HTTP server on
127.0.0.1, and a real ParameterServerStrategy cluster of processes on
localhost. Only the TPU strategy is a stand-in, since there is no TPU here.
"""

import collections
import fcntl
import functools
import hashlib
import http.server
import os
import shutil
import tempfile
import threading
from unittest import mock  # Only for the TPU stand-in: no TPU hardware here.

from absl.testing import absltest
from absl.testing import parameterized
import hypothesis
from hypothesis import strategies as st
import keras
import numpy as np
import pytest
import tensorflow as tf
import tensorflow_datasets as tfds

import tfdist
from tfdist import data
from tfdist.data import synthetic
import cluster_utils

FILE = data.ShardPolicy.FILE
DATA = data.ShardPolicy.DATA
OFF = data.ShardPolicy.OFF

_DIGITS_DIR = None


def _digits_dir() -> str:
  """A data_dir with tfdist_digits built once for this module."""
  global _DIGITS_DIR
  if _DIGITS_DIR is None:
    path = tempfile.mkdtemp(prefix="tfdist_digits_")
    data.prepare_digits(path)
    _DIGITS_DIR = path
  return _DIGITS_DIR


def tearDownModule():  # pylint: disable=invalid-name
  if _DIGITS_DIR is not None:
    shutil.rmtree(_DIGITS_DIR, ignore_errors=True)


@pytest.fixture(autouse=True, scope="module")
def _module_tempdir():
  """The module's temporary files in one directory, removed after it: TFDS
  4.9's ``DatasetInfo.initialize_from_bucket`` leaves an empty ``tmp*tfds``
  directory for every builder of a dataset not prepared (31 a run)."""
  root = tempfile.mkdtemp(prefix="tfdist_data_module_")
  saved, tempfile.tempdir = tempfile.tempdir, root
  yield
  tempfile.tempdir = saved
  shutil.rmtree(root, ignore_errors=True)


def _tempdir(test: absltest.TestCase) -> str:
  """An empty directory removed after ``test`` (absl's needs parsed flags)."""
  path = tempfile.mkdtemp(prefix="tfdist_data_test_")
  test.addCleanup(shutil.rmtree, path, ignore_errors=True)
  return path


def _mirrored():
  return tfdist.make_strategy("mirrored", devices=["/cpu:0", "/cpu:1"])


def _tpu_stand_in_no_tpu_hardware_here():
  """An 8-replica TPUStrategy stand-in that passes ``isinstance``.

  The project's one exception to real parts: there is no TPU hardware here.
  """
  strategy = mock.create_autospec(tf.distribute.TPUStrategy, instance=True)
  strategy.num_replicas_in_sync = 8
  return strategy


def _fingerprints(dataset, key="image"):
  return [hashlib.sha1(ex[key].tobytes()).hexdigest()[:16]
          for ex in dataset.as_numpy_iterator()]


def _split_fingerprints(split="test"):
  builder = tfds.builder(data.DIGITS_NAME, data_dir=_digits_dir())
  return _fingerprints(builder.as_dataset(split=split))


@functools.cache
def _file_of_each_example(split="test") -> dict[str, int]:
  """Fingerprint -> index of the split's file that holds the example.

  Read file by file with plain ``TFRecordDataset``, in the order of
  ``file_instructions``, which is the order TFDS shards files by.
  """
  builder = tfds.builder(data.DIGITS_NAME, data_dir=_digits_dir())
  features = builder.info.features
  owner = {}
  for index, instruction in enumerate(
      builder.info.splits[split].file_instructions):
    records = tf.data.TFRecordDataset(instruction.filename).map(
        features.deserialize_example)
    owner.update(dict.fromkeys(_fingerprints(records), index))
  return owner


def _file_states(root: str) -> dict[str, tuple[int, int, int]]:
  """Path -> (inode, mtime in ns, size) of every file under ``root``."""
  states = {}
  for folder, _, files in os.walk(root):
    for name in files:
      path = os.path.join(folder, name)
      stat = os.stat(path)
      states[path] = (stat.st_ino, stat.st_mtime_ns, stat.st_size)
  return states


_PROBE_NAME = "tfdist_http_probe"
_PROBE_LINES = (b"alpha", b"beta", b"gamma")
_STALL_LIMIT_S = 60.0  # The longest a stalled request is held open.


class _LocalHttpServer:
  """A real HTTP server on 127.0.0.1, on a free port, in a thread.

  ``GET /files/NAME`` answers 200 with `_PROBE_LINES`; ``GET /stall/NAME``
  accepts and answers nothing until `release` (or `_STALL_LIMIT_S`), then
  404; anything else 404. Every path asked for is kept in ``paths``.
  """

  def __init__(self):
    self.paths = []
    self.stalled = threading.Event()  # A stalling request has arrived.
    self._release = threading.Event()
    outer, release = self, self._release

    class Handler(http.server.BaseHTTPRequestHandler):

      def do_GET(self):  # pylint: disable=invalid-name
        outer.paths.append(self.path)
        if self.path.startswith("/files/"):
          body = b"\n".join(_PROBE_LINES) + b"\n"
          self.send_response(200)
          self.send_header("Content-Length", str(len(body)))
          self.end_headers()
          self.wfile.write(body)
          return
        if self.path.startswith("/stall/"):
          outer.stalled.set()
          release.wait(_STALL_LIMIT_S)
        # 404, not a 5xx: TFDS's downloader retries those.
        self.send_error(404)

      def log_message(self, *args):  # Quiet.
        del args

    self._httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    self._httpd.daemon_threads = False  # So server_close joins the handlers.
    self._thread = threading.Thread(target=self._httpd.serve_forever,
                                    name="tfdist-test-http", daemon=True)
    self._thread.start()
    self.url = f"http://127.0.0.1:{self._httpd.server_port}"

  def release(self) -> None:
    """Lets stalled requests end (with a 404)."""
    self._release.set()

  def close(self) -> None:
    self.release()
    self._httpd.shutdown()
    self._thread.join(10)
    self._httpd.server_close()  # Joins the request threads.
    assert not self._thread.is_alive(), "the HTTP server thread did not end"


def _serve(test: absltest.TestCase) -> _LocalHttpServer:
  server = _LocalHttpServer()
  test.addCleanup(server.close)
  return server


def _http_builder(url: str) -> type[tfds.core.DatasetBuilder]:
  """A TFDS builder, not registered by name, whose data is the file at url.

  Its ``train`` split has one example per line of the file, downloaded by
  TFDS's own download manager.
  """

  class TfdistHttpProbe(tfds.core.GeneratorBasedBuilder,
                        skip_registration=True):
    """Lines of one text file, downloaded over HTTP."""

    name = _PROBE_NAME
    VERSION = tfds.core.Version("1.0.0")

    def _info(self):
      return tfds.core.DatasetInfo(
          builder=self,
          features=tfds.features.FeaturesDict({"line": tfds.features.Text()}))

    def _split_generators(self, dl_manager):
      return {"train": self._generate_examples(dl_manager.download(url))}

    def _generate_examples(self, path):
      for index, line in enumerate(path.read_text().splitlines()):
        yield index, {"line": line}

  return TfdistHttpProbe


def _join_abandoned_downloads(timeout_s: float = 30.0) -> list[str]:
  """Joins tfdist's background download threads; names those still alive."""
  threads = [t for t in threading.enumerate()
             if t.name == f"tfds-prepare-{_PROBE_NAME}"]
  for thread in threads:
    thread.join(timeout_s)
  return [t.name for t in threads if t.is_alive()]


@pytest.mark.beside
class PublicSurfaceTest(absltest.TestCase):

  def test_all_names_resolve(self):
    for name in data.__all__:
      self.assertTrue(hasattr(data, name), name)
    self.assertEqual(sorted(data.__all__), data.__all__)


@pytest.mark.beside
@pytest.mark.timeout(60)
class BatchingTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("global_only", 2, 64, None, 64, 32),
      ("per_replica_only", 2, None, 32, 64, 32),
      ("both_consistent", 4, 64, 16, 64, 16),
      ("one_replica", 1, 7, None, 7, 7),
      ("numpy_int", 2, np.int64(8), None, 8, 4),
      ("eight_replicas", 8, 8, None, 8, 1),
  )
  def test_resolve(self, replicas, global_batch, per_replica, want_global,
                   want_per_replica):
    batching = data.Batching.resolve(
        num_replicas=replicas, global_batch_size=global_batch,
        per_replica_batch_size=per_replica)
    self.assertEqual(batching.global_batch_size, want_global)
    self.assertEqual(batching.per_replica_batch_size, want_per_replica)
    self.assertEqual(batching.num_replicas, replicas)

  @parameterized.named_parameters(
      ("not_divisible", dict(num_replicas=2, global_batch_size=63),
       "global_batch_size", "multiple of the 2 replicas"),
      ("zero_global", dict(num_replicas=2, global_batch_size=0),
       "global_batch_size", "positive integer"),
      ("negative_global", dict(num_replicas=2, global_batch_size=-8),
       "global_batch_size", "positive integer"),
      ("float_global", dict(num_replicas=2, global_batch_size=64.0),
       "global_batch_size", "positive integer"),
      ("bool_global", dict(num_replicas=1, global_batch_size=True),
       "global_batch_size", "positive integer"),
      ("zero_per_replica", dict(num_replicas=2, per_replica_batch_size=0),
       "per_replica_batch_size", "positive integer"),
      ("negative_per_replica", dict(num_replicas=2, per_replica_batch_size=-1),
       "per_replica_batch_size", "positive integer"),
      ("inconsistent", dict(num_replicas=2, global_batch_size=64,
                            per_replica_batch_size=16),
       "per_replica_batch_size", "32 = global_batch_size 64 / 2"),
      ("neither", dict(num_replicas=2), "global_batch_size", "nothing"),
      ("zero_replicas", dict(num_replicas=0, global_batch_size=8),
       "num_replicas", "positive integer"),
  )
  def test_resolve_rejects(self, kwargs, field, needle):
    with self.assertRaises(tfdist.ConfigError) as cm:
      data.Batching.resolve(**kwargs)
    self.assertEqual(cm.exception.field, field)
    self.assertIn(needle, str(cm.exception))
    self.assertIn(field, str(cm.exception))

  @hypothesis.settings(max_examples=200, deadline=None)
  @hypothesis.given(replicas=st.integers(1, 64),
                    global_batch=st.integers(1, 4096))
  def test_resolve_splits_exactly_or_refuses(self, replicas, global_batch):
    if global_batch % replicas:
      with self.assertRaises(tfdist.ConfigError) as cm:
        data.Batching.resolve(num_replicas=replicas,
                              global_batch_size=global_batch)
      self.assertEqual(cm.exception.field, "global_batch_size")
      return
    batching = data.Batching.resolve(num_replicas=replicas,
                                     global_batch_size=global_batch)
    self.assertEqual(batching.per_replica_batch_size * replicas, global_batch)
    self.assertEqual(
        data.Batching.resolve(
            num_replicas=replicas,
            per_replica_batch_size=batching.per_replica_batch_size),
        batching)

  def test_constructor_checks_the_sizes_agree(self):
    with self.assertRaises(tfdist.ConfigError) as cm:
      data.Batching(global_batch_size=64, per_replica_batch_size=16,
                    num_replicas=2)
    self.assertEqual(cm.exception.field, "per_replica_batch_size")

  def test_is_frozen(self):
    batching = data.Batching.resolve(num_replicas=1, global_batch_size=4)
    with self.assertRaises(AttributeError):
      batching.global_batch_size = 8  # pytype: disable=not-writable

  def test_batching_for_a_two_replica_strategy(self):
    batching = data.batching_for(_mirrored(), global_batch_size=64)
    self.assertEqual((batching.per_replica_batch_size,
                      batching.num_replicas, batching.drop_remainder),
                     (32, 2, False))

  def test_batching_for_names_the_source(self):
    with self.assertRaises(tfdist.ConfigError) as cm:
      data.batching_for(_mirrored(), global_batch_size=3,
                        source="--global_batch_size flag")
    self.assertIn("--global_batch_size flag", str(cm.exception))

  @parameterized.named_parameters(
      ("default", None, True),
      ("asked", True, True),
  )
  def test_tpu_drops_the_remainder_no_tpu_hardware_here(self, drop_remainder,
                                                        want):
    batching = data.batching_for(_tpu_stand_in_no_tpu_hardware_here(),
                                 global_batch_size=64,
                                 drop_remainder=drop_remainder)
    self.assertEqual(batching.drop_remainder, want)
    self.assertEqual(batching.per_replica_batch_size, 8)

  def test_tpu_refuses_a_partial_batch_no_tpu_hardware_here(self):
    with self.assertRaises(tfdist.ConfigError) as cm:
      data.batching_for(_tpu_stand_in_no_tpu_hardware_here(),
                        global_batch_size=64,
                        drop_remainder=False)
    self.assertEqual(cm.exception.field, "drop_remainder")

  @parameterized.named_parameters(
      ("unbatched", tf.data.Dataset.range(8), None),
      ("partial_last_batch", tf.data.Dataset.range(8).batch(4), None),
      ("drop_remainder", tf.data.Dataset.range(8).batch(4, True), 4),
      ("dict_drop_remainder", tf.data.Dataset.from_tensor_slices(
          {"x": tf.zeros([8, 3]), "y": tf.zeros([8])}).batch(2, True), 2),
  )
  def test_static_batch_size(self, dataset, want):
    self.assertEqual(data.static_batch_size(dataset), want)


@pytest.mark.beside
@pytest.mark.timeout(60)
class ShardPolicyTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("one_worker_many_files", 1, 16, OFF),
      ("one_worker_no_files", 1, None, OFF),
      ("files_equal_workers", 2, 2, FILE),
      ("more_files_than_workers", 2, 4, FILE),
      ("fewer_files_than_workers", 4, 2, DATA),
      ("one_file_two_workers", 2, 1, DATA),
      ("no_files", 2, 0, DATA),
      ("unknown_files", 2, None, DATA),
  )
  def test_choose(self, workers, files, want):
    policy = data.choose_shard_policy(num_workers=workers, num_files=files)
    self.assertEqual(policy, want)
    self.assertNotEqual(policy, data.ShardPolicy.AUTO)

  @parameterized.named_parameters(
      ("zero_workers", dict(num_workers=0, num_files=1), "num_workers"),
      ("negative_files", dict(num_workers=2, num_files=-1), "num_files"),
      ("float_workers", dict(num_workers=2.0, num_files=1), "num_workers"),
  )
  def test_choose_rejects(self, kwargs, field):
    with self.assertRaises(tfdist.ConfigError) as cm:
      data.choose_shard_policy(**kwargs)
    self.assertEqual(cm.exception.field, field)

  @parameterized.named_parameters(
      ("file", 4, 2, 1, ["f1", "f3"], FILE),
      ("data", 2, 4, 3, ["f0", "f1"], DATA),
      ("single", 3, 1, 0, ["f0", "f1", "f2"], OFF),
  )
  def test_files_for_pipeline(self, num_files, pipelines, index, want, policy):
    context = tf.distribute.InputContext(pipelines, index, pipelines)
    files = [f"f{i}" for i in range(num_files)]
    self.assertEqual(data.files_for_pipeline(files, context), (want, policy))

  def test_shard_by_data_is_disjoint_and_complete(self):
    shares = [list(data.shard_by_data(
        tf.data.Dataset.range(10),
        tf.distribute.InputContext(3, i, 3)).as_numpy_iterator())
              for i in range(3)]
    self.assertEqual(sorted(sum(shares, [])), list(range(10)))
    self.assertEqual(shares[1], [1, 4, 7])

  def test_policy_is_written_into_the_options(self):
    dataset = data.set_shard_policy(tf.data.Dataset.range(3), DATA)
    self.assertEqual(data.shard_policy_of(dataset), DATA)
    self.assertEqual(data.shard_policy_of(tf.data.Dataset.range(3)),
                     data.ShardPolicy.AUTO)

  def test_num_input_workers_single_process(self):
    self.assertEqual(data.num_input_workers(_mirrored()), 1)
    self.assertEqual(data.num_input_workers(tf.distribute.get_strategy()), 1)


@pytest.mark.beside
@pytest.mark.timeout(90)
class DigitsBuilderTest(parameterized.TestCase):

  def test_features_splits_and_shards(self):
    builder = tfds.builder(data.DIGITS_NAME, data_dir=_digits_dir())
    self.assertTrue(builder.is_prepared())
    self.assertIsInstance(builder, data.TfdistDigits)
    features = builder.info.features
    self.assertEqual(features["image"].shape, (28, 28, 1))
    self.assertEqual(features["image"].np_dtype, np.uint8)
    self.assertEqual(features["label"].num_classes, 10)
    self.assertEqual(builder.info.supervised_keys, ("image", "label"))
    for split, size in synthetic.DIGITS_SPLITS.items():
      self.assertEqual(builder.info.splits[split].num_examples, size)
      self.assertEqual(builder.info.splits[split].num_shards,
                       synthetic.DIGITS_NUM_SHARDS)

  def test_examples_are_balanced_distinct_and_in_range(self):
    examples = list(tfds.builder(data.DIGITS_NAME, data_dir=_digits_dir())
                    .as_dataset(split="test").as_numpy_iterator())
    labels = np.array([ex["label"] for ex in examples])
    self.assertEqual(np.bincount(labels, minlength=10).min(),
                     len(examples) // 10)
    self.assertEqual(len({ex["image"].tobytes() for ex in examples}),
                     len(examples))
    self.assertEqual(examples[0]["image"].dtype, np.uint8)

  def test_generation_is_deterministic(self):
    builder = data.TfdistDigits(data_dir=_digits_dir())
    # pylint: disable=protected-access
    first = list(builder._generate_examples("train", 20))
    second = list(builder._generate_examples("train", 20))
    for (key1, ex1), (key2, ex2) in zip(first, second):
      self.assertEqual(key1, key2)
      self.assertEqual(ex1["label"], ex2["label"])
      np.testing.assert_array_equal(ex1["image"], ex2["image"])
    other = list(builder._generate_examples("test", 20))
    self.assertFalse(np.array_equal(first[0][1]["image"], other[0][1]["image"]))

  def test_prepare_reuses_a_build(self):
    data_dir = _digits_dir()  # Built once for the module.
    before = _file_states(data_dir)
    self.assertNotEmpty([p for p in before if ".tfrecord-" in p])
    builder = data.prepare_digits(data_dir)
    also = data.tfds_builder(data.TfdistDigits, data_dir=data_dir)
    self.assertTrue(builder.is_prepared())
    self.assertTrue(also.is_prepared())
    # Same files, same inodes, untouched: nothing was rebuilt or added.
    self.assertEqual(_file_states(data_dir), before)

  def test_waits_for_the_build_lock_a_bounded_time(self):
    data_dir = _tempdir(self)
    lock = os.path.join(data_dir, f".tfdist-{data.DIGITS_NAME}.lock")
    with open(lock, "a+", encoding="utf-8") as held:
      fcntl.flock(held, fcntl.LOCK_EX)  # Another builder, as far as it knows.
      with self.assertRaises(tfdist.ConfigError) as cm:
        data.prepare_digits(data_dir, lock_timeout_s=0.3)
    self.assertEqual(cm.exception.field, "data_dir")
    self.assertIn("lock", str(cm.exception))

  @pytest.mark.filterwarnings("ignore:Your input ran out of data")
  def test_learnable_through_distribute_and_keras_fit(self):
    strategy = _mirrored()

    def prep(image, label):
      return tf.cast(image, tf.float32) / 255.0, label

    def examples(split):
      return lambda ctx: data.load_tfds(
          data.DIGITS_NAME, split=split, input_context=ctx,
          data_dir=_digits_dir(), as_supervised=True)

    train = data.distribute(strategy, examples("train"), global_batch_size=64,
                            map_fn=prep, shuffle_buffer_size=1024, seed=0)
    test = data.distribute(strategy, examples("test"), global_batch_size=64,
                           map_fn=prep)
    keras.utils.set_random_seed(0)
    with strategy.scope():
      model = keras.Sequential([
          keras.layers.Input((28, 28, 1)),
          keras.layers.Conv2D(8, 3, strides=2, activation="relu"),
          keras.layers.Flatten(),
          keras.layers.Dense(10)])
      model.compile(
          optimizer=keras.optimizers.Adam(1e-2), metrics=["accuracy"],
          loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(train, epochs=2, verbose=0, shuffle=False)
    accuracy = model.evaluate(test, verbose=0, return_dict=True)["accuracy"]
    self.assertGreater(accuracy, 0.5)  # Chance is 0.1.


@pytest.mark.beside
@pytest.mark.timeout(90)
class LoadTfdsTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("file_two_of_four_files", 2, FILE),
      ("file_four_of_four_files", 4, FILE),
      ("data_eight_of_four_files", 8, DATA),
  )
  def test_pipelines_read_disjoint_shares_covering_the_split(
      self, pipelines, policy):
    want = data.choose_shard_policy(
        num_workers=pipelines, num_files=synthetic.DIGITS_NUM_SHARDS)
    self.assertEqual(want, policy)
    file_of = _file_of_each_example("test")
    per_file = collections.Counter(file_of.values())
    num_files = synthetic.DIGITS_NUM_SHARDS
    shares = []
    for index in range(pipelines):
      context = tf.distribute.InputContext(pipelines, index, pipelines)
      dataset = data.load_tfds(data.DIGITS_NAME, split="test",
                               input_context=context, data_dir=_digits_dir())
      self.assertEqual(data.shard_policy_of(dataset), OFF)
      share = _fingerprints(dataset)
      shares.append(share)
      read = collections.Counter(file_of[fp] for fp in share)
      if policy == FILE:  # Whole files: this pipeline's and no others.
        self.assertEqual(sorted(read), list(range(index, num_files, pipelines)))
        self.assertEqual(read, {f: per_file[f] for f in read})
      else:  # Every file read, every pipeline-th example kept.
        self.assertLen(read, num_files)
        self.assertLen(share, sum(per_file.values()) // pipelines)
    flat = sum(shares, [])
    self.assertLen(set(flat), len(flat))  # Disjoint.
    self.assertCountEqual(flat, _split_fingerprints("test"))  # Complete.

  def test_without_context_reads_the_whole_split(self):
    dataset = data.load_tfds(data.DIGITS_NAME, split="test[:10%]",
                             data_dir=_digits_dir(), as_supervised=True)
    image_spec, label_spec = dataset.element_spec
    self.assertEqual(image_spec.shape, (28, 28, 1))
    self.assertEqual(label_spec.dtype, tf.int64)
    self.assertEqual(sum(1 for _ in dataset), 102)

  def test_mnist_through_mocked_tfds(self):
    with tfds.testing.mock_data(num_examples=12):
      whole = data.load_tfds("mnist", split="train")
      self.assertEqual(whole.element_spec["image"].shape, (28, 28, 1))
      self.assertEqual(whole.element_spec["image"].dtype, tf.uint8)
      shares = [_fingerprints(data.load_tfds(
          "mnist", split="train",
          input_context=tf.distribute.InputContext(2, i, 2)))
                for i in range(2)]
      everything = _fingerprints(whole)
    self.assertLen(shares[0], 6)
    self.assertLen(shares[1], 6)
    self.assertCountEqual(shares[0] + shares[1], everything)

  def test_mnist_dataset_fn_through_mocked_tfds(self):
    with tfds.testing.mock_data(num_examples=8):
      dataset_fn = data.tfds_dataset_fn("mnist", split="test",
                                        global_batch_size=4)
      images, labels = next(iter(dataset_fn(
          tf.distribute.InputContext(1, 0, 2))))
    self.assertEqual(images.shape, (2, 28, 28, 1))
    self.assertEqual(labels.shape, (2,))

  @parameterized.named_parameters(
      ("unknown_dataset", "no_such_dataset_xyz", "train", "dataset"),
      ("neither_name_nor_builder", 42, "train", "dataset"),
      ("unknown_split", data.DIGITS_NAME, "validation", "split"),
      ("unknown_split_of_the_class", data.TfdistDigits, "validation", "split"),
  )
  def test_rejects(self, name, split, field):
    with self.assertRaises(tfdist.ConfigError) as cm:
      data.load_tfds(name, split=split, data_dir=_digits_dir())
    self.assertEqual(cm.exception.field, field)

  def test_not_prepared_and_no_download(self):
    data_dir = _tempdir(self)
    with self.assertRaises(tfdist.ConfigError) as cm:
      data.load_tfds("mnist", split="train", data_dir=data_dir,
                     download=False)
    self.assertEqual(cm.exception.field, "dataset")
    self.assertIn("mnist", str(cm.exception))
    self.assertIn(data_dir, str(cm.exception))
    self.assertEqual(_file_states(data_dir), {})  # Nothing fetched.


@pytest.mark.beside
@pytest.mark.timeout(90)
class DownloadTest(absltest.TestCase):
  """A builder that downloads from a real HTTP server on 127.0.0.1."""

  def test_downloads_prepares_and_then_reuses(self):
    server = _serve(self)
    data_dir = _tempdir(self)
    probe = _http_builder(f"{server.url}/files/lines.txt")
    dataset = data.load_tfds(probe, split="train", data_dir=data_dir,
                             download_timeout_s=60)
    self.assertEqual([ex["line"] for ex in dataset.as_numpy_iterator()],
                     list(_PROBE_LINES))
    self.assertEqual(server.paths, ["/files/lines.txt"])
    before = _file_states(data_dir)
    again = data.load_tfds(probe, split="train", data_dir=data_dir,
                           download=False)
    self.assertEqual(sum(1 for _ in again), len(_PROBE_LINES))
    self.assertEqual(server.paths, ["/files/lines.txt"])  # Not fetched again.
    self.assertEqual(_file_states(data_dir), before)

  def test_not_prepared_and_no_download(self):
    server = _serve(self)
    data_dir = _tempdir(self)
    with self.assertRaises(tfdist.ConfigError) as cm:
      data.load_tfds(_http_builder(f"{server.url}/files/lines.txt"),
                     split="train", data_dir=data_dir, download=False)
    self.assertEqual(cm.exception.field, "dataset")
    self.assertIn(_PROBE_NAME, str(cm.exception))
    self.assertIn(data_dir, str(cm.exception))
    self.assertIn("download=True", str(cm.exception))
    self.assertEqual(server.paths, [])

  def test_failed_download_names_dataset_and_dir(self):
    server = _serve(self)
    data_dir = _tempdir(self)
    with self.assertRaises(tfdist.ConfigError) as cm:
      data.load_tfds(_http_builder(f"{server.url}/missing/lines.txt"),
                     split="train", data_dir=data_dir, download_timeout_s=60)
    message = str(cm.exception)
    self.assertIn(_PROBE_NAME, message)
    self.assertIn(data_dir, message)
    self.assertIn("DownloadError", message)
    self.assertIn("HTTP code: 404", message)
    self.assertIsInstance(cm.exception.__cause__, tfds.download.DownloadError)
    self.assertEqual(server.paths, ["/missing/lines.txt"])

  def test_stalled_download_times_out(self):
    server = _serve(self)
    data_dir = _tempdir(self)
    probe = _http_builder(f"{server.url}/stall/lines.txt")
    with self.assertRaises(tfdist.ConfigError) as cm:
      data.load_tfds(probe, split="train", data_dir=data_dir,
                     download_timeout_s=0.5)
    self.assertIn("download_timeout_s=0.5", str(cm.exception))
    self.assertIn(_PROBE_NAME, str(cm.exception))
    # The abandoned download did reach the server; let it end and join it.
    self.assertTrue(server.stalled.wait(30))
    server.release()
    self.assertEqual(_join_abandoned_downloads(), [])
    self.assertFalse(probe(data_dir=data_dir).is_prepared())


@pytest.mark.beside
@pytest.mark.timeout(90)
class DistributeTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("global", dict(global_batch_size=8)),
      ("per_replica", dict(per_replica_batch_size=4)),
  )
  def test_per_replica_batches_are_half_the_global(self, sizes):
    strategy = _mirrored()
    dist = data.distribute(
        strategy, lambda ctx: tf.data.Dataset.range(32), **sizes)
    seen = []
    for batch in dist:
      parts = strategy.experimental_local_results(batch)
      self.assertLen(parts, 2)
      self.assertEqual([int(p.shape[0]) for p in parts], [4, 4])
      seen.extend(np.concatenate([p.numpy() for p in parts]).tolist())
    self.assertEqual(sorted(seen), list(range(32)))

  def test_dataset_fn_gets_an_input_context(self):
    contexts = []

    def examples_fn(ctx):
      contexts.append(ctx)
      return tf.data.Dataset.range(4)

    next(iter(data.distribute(_mirrored(), examples_fn, global_batch_size=4)))
    self.assertLen(contexts, 1)
    self.assertIsInstance(contexts[0], tf.distribute.InputContext)
    self.assertEqual(contexts[0].num_replicas_in_sync, 2)

  @parameterized.named_parameters(
      ("not_divisible", dict(global_batch_size=7), "global_batch_size"),
      ("zero", dict(global_batch_size=0), "global_batch_size"),
      ("inconsistent", dict(global_batch_size=8, per_replica_batch_size=2),
       "per_replica_batch_size"),
      ("missing", {}, "global_batch_size"),
  )
  def test_distribute_rejects(self, sizes, field):
    with self.assertRaises(tfdist.ConfigError) as cm:
      data.distribute(_mirrored(), lambda ctx: tf.data.Dataset.range(8),
                      **sizes)
    self.assertEqual(cm.exception.field, field)

  def test_make_dataset_fn_batches_per_replica_and_states_the_policy(self):
    dataset_fn = data.make_dataset_fn(lambda ctx: tf.data.Dataset.range(10),
                                      global_batch_size=8, drop_remainder=True,
                                      shard_by_data=True)
    dataset = dataset_fn(tf.distribute.InputContext(2, 1, 4))
    self.assertEqual(data.shard_policy_of(dataset), OFF)
    self.assertEqual([b.tolist() for b in dataset.as_numpy_iterator()],
                     [[1, 3], [5, 7]])

  def test_make_dataset_fn_rejects_a_batch_the_replicas_do_not_divide(self):
    dataset_fn = data.make_dataset_fn(lambda ctx: tf.data.Dataset.range(10),
                                      global_batch_size=6)
    with self.assertRaises(tfdist.ConfigError) as cm:
      dataset_fn(tf.distribute.InputContext(1, 0, 4))
    self.assertEqual(cm.exception.field, "global_batch_size")

  def test_tpu_batches_have_a_static_size_no_tpu_hardware_here(self):
    tpu = _tpu_stand_in_no_tpu_hardware_here()
    data.distribute(tpu, lambda ctx: tf.data.Dataset.range(100),
                    global_batch_size=64)
    dataset_fn = tpu.distribute_datasets_from_function.call_args.args[0]
    dataset = dataset_fn(tf.distribute.InputContext(1, 0, 8))
    self.assertEqual(data.static_batch_size(dataset), 8)
    self.assertEqual(sum(1 for _ in dataset), 12)  # 100 // 8, remainder gone.

  def test_unknown_batch_size_cannot_be_split(self):
    with self.assertRaises(tfdist.ConfigError) as cm:
      data.distribute_dataset(_mirrored(), tf.data.Dataset.range(10).batch(4))
    self.assertEqual(cm.exception.field, "global_batch_size")
    self.assertIn("2 replicas", str(cm.exception))

  @parameterized.named_parameters(
      ("disagrees", tf.data.Dataset.range(16).batch(8, True), 4),
      ("not_divisible", tf.data.Dataset.range(16).batch(3), 3),
  )
  def test_distribute_dataset_rejects(self, dataset, global_batch_size):
    with self.assertRaises(tfdist.ConfigError) as cm:
      data.distribute_dataset(_mirrored(), dataset,
                              global_batch_size=global_batch_size)
    self.assertEqual(cm.exception.field, "global_batch_size")

  @parameterized.named_parameters(
      ("static", tf.data.Dataset.range(16).batch(8, True), None),
      ("given", tf.data.Dataset.range(16).batch(8), 8),
  )
  def test_distribute_dataset_states_the_policy(self, dataset, size):
    strategy = _mirrored()
    dist = data.distribute_dataset(strategy, dataset, global_batch_size=size)
    # The dataset tf.distribute was given (a private attribute: with one
    # worker the policy changes nothing else that could be observed; the
    # multi-worker test checks TF's log for the AUTO warning instead).
    given = dist._original_dataset  # pylint: disable=protected-access
    self.assertEqual(data.shard_policy_of(given), OFF)
    parts = strategy.experimental_local_results(next(iter(dist)))
    self.assertEqual([p.numpy().tolist() for p in parts],
                     [[0, 1, 2, 3], [4, 5, 6, 7]])


@pytest.mark.timeout(150)
class ParameterServerTest(absltest.TestCase):
  """A real ps cluster on localhost: the chief, 2 workers and 1 ps, each a
  process."""

  def test_batches_are_made_and_consumed_on_the_workers(self):
    result = cluster_utils.run_script("data_parameter_server.py", timeout=140)
    self.assertEqual(result.returncode, 0, result.stderr[-3000:])
    report = result.json()
    self.assertTrue(report["is_pss"])
    self.assertEqual(report["replicas"], 1)
    field, message = report["errors"]["no_coordinator"]
    self.assertEqual(field, "coordinator")
    self.assertIn("create_per_worker_dataset", message)
    field, message = report["errors"]["distribute_dataset"]
    self.assertEqual(field, "strategy")
    self.assertIn("coordinator=", message)
    self.assertIn("PerWorker", report["dataset_type"])
    # Each worker builds the whole pipeline: one pipeline, one replica.
    self.assertEqual(report["contexts"], [[1, 0, 1]])
    # Every step got a full batch of 4 consecutive examples, mapped (x10),
    # from one of the workers' own iterators over range(16), repeated.
    batches = report["batches"]
    self.assertLen(batches, 10)
    starts = collections.Counter()
    for batch in batches:
      self.assertLen(batch, 4)
      start = batch[0] // 10
      self.assertEqual(batch, [10 * (start + i) for i in range(4)])
      self.assertEqual(start % 4, 0)
      starts[start] += 1
    # Each worker reads from the start, in order, so no batch was served
    # more often than the one before it in the sequence.
    counts = [starts[s] for s in range(0, 16, 4)]
    self.assertEqual(counts, sorted(counts, reverse=True))
    self.assertGreater(counts[0], 0)


@pytest.mark.timeout(180)
class MultiWorkerTest(absltest.TestCase):

  def test_two_workers_build_once_and_read_disjoint_shards(self):
    data_dir = _tempdir(self)  # Nothing built yet.
    results = cluster_utils.run_cluster(
        "data_workers.py", cluster_utils.worker_configs(2), args=[data_dir],
        timeout=170,
        # Shows TF's AUTO-sharding message (a VLOG(2) in auto_shard.cc).
        env={"TF_CPP_MIN_LOG_LEVEL": "0", "TF_CPP_VMODULE": "auto_shard=2"})
    reports = []
    for result in results:
      self.assertEqual(result.returncode, 0, result.stderr[-3000:])
      reports.append(result.json())
      ours, _, control = result.stderr.partition("--- control ---")
      self.assertTrue(control, result.stderr[-3000:])
      self.assertNotIn("AUTO sharding policy", ours)
      self.assertIn("AUTO sharding policy", control)  # The capture works.
    # Both processes asked for the dataset; the chief (worker 0) built it.
    self.assertEqual([r.stderr.count("tfdist: preparing tfdist_digits")
                      for r in results], [1, 0])
    for report in reports:
      self.assertEqual(report["replicas"], 2)
      self.assertEqual(report["input_workers"], 2)
      self.assertEqual(report["batch_sizes"], [32])  # 64 / 2 replicas.
    first, second = (set(r["seen"]) for r in reports)
    self.assertFalse(first & second)
    self.assertCountEqual(reports[0]["seen"] + reports[1]["seen"],
                          _fingerprints(tfds.builder(
                              data.DIGITS_NAME, data_dir=data_dir)
                                        .as_dataset(split="test")))
    # DATA sharding of a file-less dataset: each worker its half of a batch.
    self.assertEqual(sorted(r["ranged_first"][0] for r in reports),
                     [[0, 1, 2, 3], [4, 5, 6, 7]])


if __name__ == "__main__":
  absltest.main()
