"""save_model writes beside what is there, or refuses before touching it.

Real files in a fresh working directory: a trailing slash, ``.``, a parent,
or an existing directory or file never loses what was there.
"""

import os
import shutil
import tempfile

from absl.testing import absltest
from absl.testing import parameterized
import hypothesis
from hypothesis import strategies as st
import keras
import numpy as np
import pytest

import tfdist

pytestmark = pytest.mark.beside  # tests/conftest.py: starts no cluster.


def _model() -> keras.Model:
  model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
  model.compile(optimizer="sgd", loss="mse")
  return model


def _tree(root):
  out = {}
  for parent, dirs, files in os.walk(root):
    for name in files + dirs:
      path = os.path.join(parent, name)
      content = None
      if os.path.isfile(path):
        with open(path, "rb") as f:
          content = f.read()
      out[os.path.relpath(path, root)] = content
  return out


@pytest.mark.timeout(300)
class SaveModelPathTest(parameterized.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.model = _model()

  def setUp(self):
    super().setUp()
    # The working directory is deep enough to have parents to protect.
    self.root = tempfile.mkdtemp()
    self.addCleanup(shutil.rmtree, self.root)
    self.dir = os.path.join(self.root, "a", "b")
    os.makedirs(os.path.join(self.dir, "results"))
    os.mkdir(os.path.join(self.dir, "out"))
    for name in ("results/a.txt", "results/m.keras", "out/keep.txt",
                 "mine.txt"):
      with open(os.path.join(self.dir, name), "w") as f:
        f.write("the user's")
    cwd = os.getcwd()
    os.chdir(self.dir)
    self.addCleanup(os.chdir, cwd)

  def test_trailing_slash_writes_beside_what_is_there(self):
    before = _tree(self.root)
    self.assertEqual(tfdist.save_model(self.model, "out/model/"), "out/model/")
    after = _tree(self.root)
    self.assertEqual({k: v for k, v in after.items() if k in before}, before)
    self.assertEqual(sorted(os.listdir("out")), ["keep.txt", "model"])
    self.assertTrue(os.path.isfile(os.path.join("out", "model",
                                                "saved_model.pb")))

  @parameterized.named_parameters(
      ("working_directory", "."),
      ("working_directory_slash", "./"),
      ("working_directory_absolute", None),
      ("parent", ".."),
      ("grandparent_slash", "../../"),
      ("root", "/"),
      ("directory_with_files", "results"),
      ("directory_with_files_slash", "results/"),
      ("existing_keras_file", "results/m.keras"),
      ("existing_other_file", "mine.txt"),
  )
  def test_refused_before_touching_anything(self, path):
    path = self.dir if path is None else path
    before = _tree(self.root)
    with self.assertRaises(tfdist.ConfigError) as caught:
      tfdist.save_model(self.model, path)
    self.assertEqual(caught.exception.field, "path")
    self.assertEqual(_tree(self.root), before)

  @hypothesis.settings(max_examples=40, deadline=None)
  @hypothesis.given(st.lists(st.sampled_from(["sub", ".", "..", "results",
                                              "mine.txt", "out"]),
                             min_size=1, max_size=6), st.booleans())
  def test_spellings_of_what_is_there_are_refused(self, parts, slash):
    """Any spelling that lands on the working directory, a parent, or
    something of the user's is refused, and nothing changes."""
    path = os.path.join(*parts) + ("/" if slash else "")
    final = os.path.abspath(path)
    theirs = os.path.lexists(final) and not (
        os.path.isdir(final) and not os.listdir(final))
    hypothesis.assume(theirs or self.dir.startswith(final))
    before = _tree(self.root)
    with self.assertRaises(tfdist.ConfigError):
      tfdist.save_model(self.model, path)
    self.assertEqual(_tree(self.root), before)

  def test_empty_directory_is_filled(self):
    os.mkdir("empty")
    tfdist.save_model(self.model, "empty")
    self.assertIn("saved_model.pb", os.listdir("empty"))

  @parameterized.named_parameters(("keras_file", "m.keras"),
                                  ("saved_model", "exported"))
  def test_saving_again_replaces_this_process_export(self, path):
    model = _model()
    tfdist.save_model(model, path)
    model.layers[0].kernel.assign(np.full((2, 1), 7.0, "float32"))
    tfdist.save_model(model, path)
    self.assertEqual(sorted(n for n in os.listdir(".")
                            if n not in ("results", "out", "mine.txt")),
                     [path])  # No temporary left beside it.
    if path.endswith(".keras"):
      reloaded = keras.saving.load_model(path)
      np.testing.assert_allclose(reloaded.layers[0].kernel.numpy(), 7.0)


if __name__ == "__main__":
  absltest.main()
