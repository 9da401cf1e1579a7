"""Tests for tfdist.cluster.hostlist, checked against SLURM's own parser."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from absl.testing import absltest
from absl.testing import parameterized
import hypothesis
from hypothesis import strategies as st
import pytest

import slurm_harness
from tfdist import ConfigError
from tfdist import expand_hostlist
from tfdist import expand_tasks_per_node
from tfdist.cluster.hostlist import MAX_RANGE  # The parser's own bound.

pytestmark = pytest.mark.timeout(60)

_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_VALID = (
    ("single", "n1", ["n1"]),
    ("rank_order_not_string_order", "n[9-10]", ["n9", "n10"]),
    ("zero_padded", "n[008-010]", ["n008", "n009", "n010"]),
    ("width_from_low_bound", "n[01-3]", ["n01", "n02", "n03"]),
    ("high_bound_padding_ignored", "n[1-03]", ["n1", "n2", "n3"]),
    ("grows_past_width", "n[8-10]", ["n8", "n9", "n10"]),
    ("padded_single", "n[007]", ["n007"]),
    ("comma_inside", "n[1-2,5]", ["n1", "n2", "n5"]),
    ("comma_inside_keeps_order", "n[5,1-2]", ["n5", "n1", "n2"]),
    ("comma_outside", "n[1-2],m[3-4]", ["n1", "n2", "m3", "m4"]),
    ("plain_names", "login1,gpu-a,c.d", ["login1", "gpu-a", "c.d"]),
    ("two_groups", "r[1-2]n[3-4]", ["r1n3", "r1n4", "r2n3", "r2n4"]),
    ("two_groups_with_commas", "r[1,2]n[3,4]", ["r1n3", "r1n4", "r2n3", "r2n4"]),
    ("adjacent_groups", "n[1-2][3-4]", ["n13", "n14", "n23", "n24"]),
    # SLURM peels groups off the prefix from the right: g2 outermost, then
    # g1, with the last group innermost.
    ("three_groups_slurm_order", "a[1-2]b[1-2][1-2]",
     ["a1b11", "a1b12", "a2b11", "a2b12", "a1b21", "a1b22", "a2b21",
      "a2b22"]),
    ("text_between_groups", "rack[1-2]-node[7]", ["rack1-node7", "rack2-node7"]),
    # The one extension to SLURM 22.05, which rejects a suffix.
    ("suffix_after_bracket", "n[1-2]-ib", ["n1-ib", "n2-ib"]),
    ("suffix_after_two_groups", "n[1-2]x[1-2]y", ["n1x1y", "n1x2y", "n2x1y",
                                                 "n2x2y"]),
    ("digit_after_bracket", "n[1-2]1", ["n11", "n21"]),
    ("suffix_and_padding", "gpu[08-10].ib,c1", ["gpu08.ib", "gpu09.ib",
                                                "gpu10.ib", "c1"]),
    ("duplicates_inside", "n[1,1,2]", ["n1", "n1", "n2"]),
    ("duplicates_overlapping", "n[1-3,2]", ["n1", "n2", "n3", "n2"]),
    ("duplicates_outside", "n1,n[1-2],n1", ["n1", "n1", "n2", "n1"]),
    ("empty_items_skipped", ",a,,b,", ["a", "b"]),
    ("whitespace_separates", "a b\tc\nd", ["a", "b", "c", "d"]),
    ("empty_prefix", "[1-2]", ["1", "2"]),
    ("zero", "n[0]", ["n0"]),
    ("leading_zero_names_kept", "n01,n1", ["n01", "n1"]),
)

_MALFORMED = (
    ("empty", ""),
    ("only_separators", " ,, "),
    ("backwards", "n[3-1]"),
    ("empty_brackets", "n[]"),
    ("empty_item", "n[1,,2]"),
    ("trailing_comma_inside", "n[1-2,]"),
    ("letters", "n[a-b]"),
    ("negative", "n[-1]"),
    ("double_dash", "n[1--2]"),
    ("no_upper_bound", "n[1-]"),
    ("box", "n[1x2]"),
    ("decimal", "n[1.5]"),
    ("space_inside", "n[ 1-2]"),
    ("sign_inside", "n[+1-2]"),
    ("unclosed", "n[1-2"),
    ("unopened", "n1-2]"),
    ("stray_close", "a]b"),
    ("extra_close", "n[1-2]]"),
    ("nested", "n[[1-2]]"),
    ("range_too_large", f"n[0-{MAX_RANGE}]"),
    ("number_overflows_64_bits", "n[99999999999999999999]"),
    ("too_many_names", "n[0-65535]x[0-65535]"),
)


class ExpandHostlistTest(parameterized.TestCase):

  @parameterized.named_parameters(*_VALID)
  def test_valid(self, text, expected):
    self.assertEqual(expand_hostlist(text), expected)

  @parameterized.named_parameters(*_MALFORMED)
  def test_malformed(self, text):
    with self.assertRaises(ConfigError) as ctx:
      expand_hostlist(text, source="a test", field="SLURM_STEP_NODELIST")
    self.assertEqual(ctx.exception.field, "SLURM_STEP_NODELIST")
    self.assertEqual(ctx.exception.value, text)
    self.assertEqual(ctx.exception.source, "a test")
    self.assertIn("hostlist", ctx.exception.expected)

  def test_not_a_string(self):
    with self.assertRaises(ConfigError):
      expand_hostlist(None)  # type: ignore[arg-type]

  def test_largest_range(self):
    names = expand_hostlist(f"n[0-{MAX_RANGE - 1}]")
    self.assertLen(names, MAX_RANGE)
    self.assertEqual(names[-1], f"n{MAX_RANGE - 1}")

  def test_message_says_why(self):
    with self.assertRaisesRegex(ConfigError, r"'3-1'.*backwards"):
      expand_hostlist("n[3-1]")

  def test_does_not_import_tensorflow(self):
    # hostlist.py must stay importable without TensorFlow.
    code = ("import sys, tfdist.cluster.hostlist, tfdist.cluster.slurm;"
            "sys.exit('tensorflow' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], timeout=60,
                          check=False, cwd=_REPO_ROOT)
    self.assertEqual(proc.returncode, 0)


@pytest.mark.beside
class ExpandTasksPerNodeTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("single", "1", [1]),
      ("list", "4,1", [4, 1]),
      ("repeat", "1(x3)", [1, 1, 1]),
      ("mixed", "2(x3),1", [2, 2, 2, 1]),
      ("mixed_middle", "1,3(x2),2", [1, 3, 3, 2]),
  )
  def test_valid(self, text, expected):
    self.assertEqual(expand_tasks_per_node(text), expected)

  @parameterized.named_parameters(
      ("empty", ""),
      ("word", "two"),
      ("zero_repeat", "2(x0)"),
      ("missing_repeat", "2(x)"),
      ("missing_count", "(x2)"),
      ("no_parens", "2x3"),
      ("unclosed", "2(x3"),
      ("empty_item", "2,,1"),
      ("trailing_comma", "2(x3),"),
      ("space", " 2"),
      ("negative", "-1"),
      ("decimal", "1.5"),
  )
  def test_malformed(self, text):
    with self.assertRaises(ConfigError) as ctx:
      expand_tasks_per_node(text, source="a test",
                            field="SLURM_TASKS_PER_NODE")
    self.assertEqual(ctx.exception.field, "SLURM_TASKS_PER_NODE")
    self.assertEqual(ctx.exception.value, text)


# ------------------------------------------------- agreement with SLURM.

@st.composite
def _number(draw, low=0, high=25):
  value = draw(st.integers(low, high))
  return "0" * draw(st.sampled_from([0, 0, 0, 1, 2])) + str(value)


@st.composite
def _range_item(draw):
  kind = draw(st.sampled_from(
      ["single", "range", "range", "range", "backwards", "junk"]))
  if kind == "single":
    return draw(_number())
  lo = draw(_number())
  if kind == "range":
    return f"{lo}-{draw(_number(int(lo), int(lo) + 6))}"
  if kind == "backwards" and int(lo) > 0:
    return f"{lo}-{draw(_number(0, int(lo) - 1))}"
  return draw(st.sampled_from(["", "a", "1-", "-1", "1-2-3", "x", "1x2"]))


@st.composite
def _name(draw):
  text = draw(st.text(alphabet="abnr-._", min_size=0, max_size=3))
  for _ in range(draw(st.integers(0, 3))):
    items = draw(st.lists(_range_item(), min_size=1, max_size=2))
    text += "[" + ",".join(items) + "]"
    # Text between groups is fine; after the last one it is tfdist's extension.
    text += draw(st.sampled_from(["", "", "", "x", "-ib", "1"]))
  return text


@st.composite
def _hostlist(draw):
  names = draw(st.lists(_name(), min_size=0, max_size=3))
  separators = draw(st.lists(st.sampled_from([",", ",", ",,", " ", "\t"]),
                             min_size=len(names) + 1,
                             max_size=len(names) + 1))
  if not draw(st.booleans()):
    separators[0] = separators[-1] = ""
  out = separators[0]
  for name, sep in zip(names, separators[1:]):
    out += name + sep
  return out


# Random strings over the characters that matter.
_fuzz = st.text(alphabet="n01-9[],x ", max_size=12)


def _deliberate_difference(text: str) -> str | None:
  """Why tfdist rejects ``text`` although SLURM may accept it, or None.

  SLURM accepts these and makes names such as ``n]`` or ``n01`` from
  ``n[1-2`` and ``n[ 1-2]``; tfdist.cluster.hostlist documents that it
  rejects them.
  """
  depth = 0
  for char in text:
    depth += (char == "[") - (char == "]")
    if depth not in (0, 1):
      return "unbalanced or nested brackets"
  if depth:
    return "unclosed bracket"
  for body in re.findall(r"\[([^\]]*)\]", text):
    if re.search(r"[\s+]", body):
      return "space or sign inside brackets"
    if any(re.fullmatch(r"[0-9]+-", item) for item in body.split(",")):
      return "range without upper bound"
    if any(int(n) >= 2**64 for n in re.findall(r"[0-9]+", body)):
      return "number past 2**64 - 1, which SLURM clamps"
  return None


# A name with text after its last bracket group: tfdist's one extension.
_SUFFIX = re.compile(r"\][^\[\],\s]+(?=[,\s]|$)")


def _split_names(text: str) -> list[str]:
  return [t for t in re.split(r"[,\s]+(?![^\[]*\])", text) if t]


@pytest.mark.beside
class AgreesWithSlurmTest(parameterized.TestCase):
  """`expand_hostlist` against ``scontrol show hostnames``."""

  def setUp(self):
    super().setUp()
    reason = slurm_harness.slurm_unavailable_reason()
    if reason:
      self.skipTest(reason)

  def check(self, text):
    if _deliberate_difference(text) is None and _SUFFIX.search(text):
      self.check_suffixed(text)
      return
    slurm = slurm_harness.scontrol_hostnames(text)
    why = _deliberate_difference(text)
    if why or not slurm.accepted or not slurm.names:
      with self.assertRaises(
          ConfigError, msg=f"{text!r}: SLURM gave {slurm}, reason {why}"):
        expand_hostlist(text)
    else:
      self.assertEqual(expand_hostlist(text), slurm.names, msg=repr(text))

  def check_suffixed(self, text):
    """SLURM expands each name without its suffix; tfdist then appends it."""
    expected = []
    for name in _split_names(text):
      match = re.fullmatch(r"(.*\])([^\[\]]+)", name)
      base, suffix = match.groups() if match else (name, "")
      slurm = slurm_harness.scontrol_hostnames(base)
      if not slurm.accepted or not slurm.names:
        with self.assertRaises(ConfigError, msg=f"{text!r}: {base!r} {slurm}"):
          expand_hostlist(text)
        return
      expected += [n + suffix for n in slurm.names]
    self.assertEqual(expand_hostlist(text), expected, msg=repr(text))

  @parameterized.named_parameters(
      [(f"valid_{name}", text) for name, text, _ in _VALID]
      + [(f"malformed_{name}", text) for name, text in _MALFORMED
         if name != "too_many_names"])  # scontrol would print 4e9 lines.
  def test_tables(self, text):
    self.check(text)

  @pytest.mark.timeout(120)
  @hypothesis.settings(max_examples=400, deadline=None,
                       suppress_health_check=[hypothesis.HealthCheck.too_slow])
  @hypothesis.given(st.one_of(_hostlist(), _hostlist(), _fuzz))
  def test_random_expressions(self, text):
    self.check(text)


if __name__ == "__main__":
  absltest.main()
