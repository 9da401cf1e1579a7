"""Tests for tfdist.cluster.tf_config."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import types

from absl.testing import absltest
from absl.testing import parameterized
import hypothesis
from hypothesis import strategies as st
import pytest

from tfdist import ClusterInfo
from tfdist import ConfigError
from tfdist import TfdistError
from tfdist.cluster import tf_config

_SOURCE = "TF_CONFIG in test"
_MISSING = "nothing (missing)"
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_CLUSTER = {"chief": ["chief:2222"], "worker": ["w0:2222", "w1:2222"]}
_PS_CLUSTER = {"chief": ["c:2222"], "worker": ["w0:2222", "w1:2222"],
               "ps": ["ps0:2222", "ps1:2222"]}


def _config(cluster=None, task=None, **extra):
  """A TF_CONFIG dict: `_CLUSTER` and worker 0 unless told otherwise."""
  config = {"cluster": _CLUSTER if cluster is None else cluster,
            "task": {"type": "worker", "index": 0} if task is None else task}
  config.update(extra)
  return config


class _Unprintable(dict):
  """A config holding an int too long for repr(); it prints short itself."""

  def __repr__(self):
    return "<a config with an integer of 5001 digits>"


def _without(key, **kwargs):
  config = _config(**kwargs)
  del config[key]
  return config


def _worker(index):
  return {"type": "worker", "index": index}


def _workers(*addresses):
  return {"worker": list(addresses)}


# (name, config, cluster, task_type, task_id, rpc_layer)
_VALID = (
    ("chief_and_workers", _config(task={"type": "chief", "index": 0}),
     _CLUSTER, "chief", 0, "grpc"),
    ("worker_of_chief_cluster", _config(task=_worker(1)),
     _CLUSTER, "worker", 1, "grpc"),
    ("workers_only", _config(_workers("a:1", "b:1", "c:1"), _worker(2)),
     _workers("a:1", "b:1", "c:1"), "worker", 2, "grpc"),
    ("single_worker", _config(_workers("localhost:12345"), _worker(0)),
     _workers("localhost:12345"), "worker", 0, "grpc"),
    ("single_chief", _config({"chief": ["c:2222"]},
                             {"type": "chief", "index": 0}),
     {"chief": ["c:2222"]}, "chief", 0, "grpc"),
    ("ps_cluster_ps_task", _config(_PS_CLUSTER, {"type": "ps", "index": 1}),
     _PS_CLUSTER, "ps", 1, "grpc"),
    ("ps_cluster_worker_task", _config(_PS_CLUSTER, _worker(1)),
     _PS_CLUSTER, "worker", 1, "grpc"),
    ("ps_cluster_chief_task", _config(_PS_CLUSTER,
                                      {"type": "chief", "index": 0}),
     _PS_CLUSTER, "chief", 0, "grpc"),
    ("ps_without_chief", _config({"worker": ["w:1"], "ps": ["p:1"]},
                                 {"type": "ps", "index": 0}),
     {"worker": ["w:1"], "ps": ["p:1"]}, "ps", 0, "grpc"),
    ("evaluator", _config(task={"type": "evaluator", "index": 0}),
     _CLUSTER, "evaluator", 0, "grpc"),
    ("ipv6", _config(_workers("[::1]:2222", "[fe80::1%eth0]:2223",
                              "[2001:db8::7]:65535"), _worker(1)),
     _workers("[::1]:2222", "[fe80::1%eth0]:2223", "[2001:db8::7]:65535"),
     "worker", 1, "grpc"),
    ("ipv4", _config(_workers("10.0.0.1:1", "10.0.0.2:65535"), _worker(0)),
     _workers("10.0.0.1:1", "10.0.0.2:65535"), "worker", 0, "grpc"),
    ("hostnames", _config(_workers("node-01.cluster.local:2222",
                                   "node_02.example.com.:2222",
                                   "N3:2222"), _worker(2)),
     _workers("node-01.cluster.local:2222", "node_02.example.com.:2222",
              "N3:2222"), "worker", 2, "grpc"),
    ("same_host_other_ports", _config(_workers("h:2222", "h:2223"),
                                      _worker(1)),
     _workers("h:2222", "h:2223"), "worker", 1, "grpc"),
    ("rpc_layer", _config(rpc_layer="grpc+verbs"),
     _CLUSTER, "worker", 0, "grpc+verbs"),
    ("environment", _config(environment="cloud"),
     _CLUSTER, "worker", 0, "grpc"),
    ("session_master", _config(session_master="grpc://chief:2222"),
     _CLUSTER, "worker", 0, "grpc"),
    ("index_as_decimal_string", _config(task=_worker("1")),
     _CLUSTER, "worker", 1, "grpc"),
    ("dense_dict_job", _config({"worker": {"1": "b:1", "0": "a:1"}},
                               _worker(1)),
     _workers("a:1", "b:1"), "worker", 1, "grpc"),
)

_BAD_TASK = {"type": "worker", "index": 0}

# (name, config, field, received): `received` must appear in the message.
_MALFORMED = (
    # The JSON text.
    ("empty_text", "", "TF_CONFIG", "''"),
    ("whitespace_text", "  \n", "TF_CONFIG", "'  \\n'"),
    ("truncated_json", '{"cluster": ', "TF_CONFIG", "'{\"cluster\": '"),
    ("trailing_comma", '{"cluster": {},}', "TF_CONFIG", "'{\"cluster\": {},}'"),
    ("single_quotes", "{'task': 1}", "TF_CONFIG", "\"{'task': 1}\""),
    ("json_list", "[1, 2]", "TF_CONFIG", "[1, 2]"),
    ("json_string", '"worker"', "TF_CONFIG", "'worker'"),
    ("json_null", "null", "TF_CONFIG", "None"),
    ("not_text_or_mapping", 42, "TF_CONFIG", "42"),
    ("duplicate_json_key",
     '{"task": {"type": "worker", "index": 0}, "task": {}}',
     "TF_CONFIG key 'task'", "'task'"),
    # Top-level keys.
    ("unknown_key", _config(clusters=_CLUSTER), "TF_CONFIG key 'clusters'",
     "'clusters'"),
    ("unknown_key_tasks", _config(tasks=[]), "TF_CONFIG key 'tasks'",
     "'tasks'"),
    # cluster.
    ("missing_cluster", _without("cluster"), "TF_CONFIG cluster", _MISSING),
    ("cluster_list", _config(["w0:2222"]), "TF_CONFIG cluster",
     "['w0:2222']"),
    ("cluster_string", _config("w0:2222"), "TF_CONFIG cluster", "'w0:2222'"),
    ("cluster_empty", _config({}, _BAD_TASK), "TF_CONFIG cluster", "{}"),
    ("job_name_unknown", _config({"trainer": ["t:1"]}),
     "TF_CONFIG cluster.trainer", "'trainer'"),
    ("job_name_master", _config({"master": ["m:1"], "worker": ["w:1"]}),
     "TF_CONFIG cluster.master", "'master'"),
    ("evaluator_in_cluster", _config({"worker": ["w:1"], "evaluator": ["e:1"]}),
     "TF_CONFIG cluster.evaluator", "['e:1']"),
    ("job_is_string", _config({"worker": "w0:2222"}),
     "TF_CONFIG cluster.worker", "'w0:2222'"),
    ("job_is_null", _config({"worker": None}), "TF_CONFIG cluster.worker",
     "None"),
    ("job_empty", _config({"chief": ["c:1"], "worker": []},
                          {"type": "chief", "index": 0}),
     "TF_CONFIG cluster.worker", "[]"),
    ("sparse_job", _config({"worker": {"0": "a:1", "2": "b:1"}}),
     "TF_CONFIG cluster.worker", "{'0': 'a:1', '2': 'b:1'}"),
    ("sparse_job_bad_index", _config({"worker": {"first": "a:1"}}),
     "TF_CONFIG cluster.worker index", "'first'"),
    ("two_chiefs", _config({"chief": ["c0:1", "c1:1"], "worker": ["w:1"]}),
     "TF_CONFIG cluster.chief", "['c0:1', 'c1:1']"),
    ("ps_only", _config({"ps": ["p0:1", "p1:1"]}, {"type": "ps", "index": 0}),
     "TF_CONFIG cluster.worker", _MISSING),
    ("ps_with_chief_only", _config({"chief": ["c:1"], "ps": ["p:1"]},
                                   {"type": "chief", "index": 0}),
     "TF_CONFIG cluster.worker", _MISSING),
    # Addresses.
    ("address_not_string", _config(_workers(2222)),
     "TF_CONFIG cluster.worker[0]", "2222"),
    ("address_no_port", _config(_workers("w0:1", "w1")),
     "TF_CONFIG cluster.worker[1]", "'w1'"),
    ("address_empty_port", _config(_workers("w0:")),
     "TF_CONFIG cluster.worker[0]", "'w0:'"),
    ("address_port_zero", _config(_workers("w0:0")),
     "TF_CONFIG cluster.worker[0]", "'w0:0'"),
    ("address_port_too_big", _config(_workers("w0:65536")),
     "TF_CONFIG cluster.worker[0]", "'w0:65536'"),
    ("address_port_negative", _config(_workers("w0:-1")),
     "TF_CONFIG cluster.worker[0]", "'w0:-1'"),
    ("address_port_name", _config(_workers("w0:grpc")),
     "TF_CONFIG cluster.worker[0]", "'w0:grpc'"),
    ("address_empty_host", _config(_workers(":2222")),
     "TF_CONFIG cluster.worker[0]", "':2222'"),
    ("address_with_scheme", _config({"chief": ["grpc://c:2222"]},
                                    {"type": "chief", "index": 0}),
     "TF_CONFIG cluster.chief[0]", "'grpc://c:2222'"),
    ("address_with_space", _config(_workers("w 0:2222")),
     "TF_CONFIG cluster.worker[0]", "'w 0:2222'"),
    ("hostname_leading_hyphen", _config(_workers("-w0:2222")),
     "TF_CONFIG cluster.worker[0]", "'-w0:2222'"),
    ("hostname_empty_label", _config(_workers("a..b:2222")),
     "TF_CONFIG cluster.worker[0]", "'a..b:2222'"),
    ("hostname_label_too_long", _config(_workers("a" * 64 + ":2222")),
     "TF_CONFIG cluster.worker[0]", "'" + "a" * 64 + ":2222'"),
    ("bad_ipv4", _config(_workers("10.0.0.256:2222")),
     "TF_CONFIG cluster.worker[0]", "'10.0.0.256:2222'"),
    ("ipv6_without_brackets", _config(_workers("::1:2222")),
     "TF_CONFIG cluster.worker[0]", "'::1:2222'"),
    ("ipv6_invalid", _config(_workers("[::g]:2222")),
     "TF_CONFIG cluster.worker[0]", "'[::g]:2222'"),
    ("ipv6_without_port", _config(_workers("[::1]")),
     "TF_CONFIG cluster.worker[0]", "'[::1]'"),
    ("two_colons", _config(_workers("w0:2222:")),
     "TF_CONFIG cluster.worker[0]", "'w0:2222:'"),
    ("duplicate_in_job", _config(_workers("w:1", "w:2", "w:1")),
     "TF_CONFIG cluster.worker[2]", "'w:1'"),
    ("duplicate_across_jobs", _config({"chief": ["h:1"], "worker": ["h:1"]}),
     "TF_CONFIG cluster.worker[0]", "'h:1'"),
    ("duplicate_ignoring_case", _config(_workers("Host:1", "host:1")),
     "TF_CONFIG cluster.worker[1]", "'host:1'"),
    ("duplicate_spelled_differently", _config(_workers("w0:2222",
                                                       "W0.:02222")),
     "TF_CONFIG cluster.worker[1]", "'W0.:02222'"),
    ("duplicate_ipv6", _config(_workers("[::1]:1", "[::1]:1")),
     "TF_CONFIG cluster.worker[1]", "'[::1]:1'"),
    # task.
    ("missing_task", _without("task"), "TF_CONFIG task", _MISSING),
    ("task_list", _config(task=["worker", 0]), "TF_CONFIG task",
     "['worker', 0]"),
    ("task_unknown_key", _config(task={"type": "worker", "id": 0}),
     "TF_CONFIG task key 'id'", "'id'"),
    ("task_missing_type", _config(task={"index": 0}), "TF_CONFIG task.type",
     _MISSING),
    ("task_type_int", _config(task={"type": 1, "index": 0}),
     "TF_CONFIG task.type", "1"),
    ("task_type_unknown", _config(task={"type": "master", "index": 0}),
     "TF_CONFIG task.type", "'master'"),
    ("task_type_not_in_cluster", _config(task={"type": "ps", "index": 0}),
     "TF_CONFIG task.type", "'ps'"),
    ("task_type_case", _config(task={"type": "Worker", "index": 0}),
     "TF_CONFIG task.type", "'Worker'"),
    ("task_missing_index", _config(task={"type": "worker"}),
     "TF_CONFIG task.index", _MISSING),
    ("index_null", _config(task=_worker(None)), "TF_CONFIG task.index",
     "None"),
    ("index_bool", _config(task=_worker(True)), "TF_CONFIG task.index",
     "True"),
    ("index_float", _config(task=_worker(1.0)), "TF_CONFIG task.index",
     "1.0"),
    ("index_fraction", _config(task=_worker(0.5)), "TF_CONFIG task.index",
     "0.5"),
    ("index_negative", _config(task=_worker(-1)), "TF_CONFIG task.index",
     "-1"),
    ("index_negative_string", _config(task=_worker("-1")),
     "TF_CONFIG task.index", "'-1'"),
    ("index_word", _config(task=_worker("one")), "TF_CONFIG task.index",
     "'one'"),
    ("index_padded_string", _config(task=_worker(" 1")),
     "TF_CONFIG task.index", "' 1'"),
    ("index_out_of_range", _config(task=_worker(2)), "TF_CONFIG task.index",
     "2"),
    ("chief_index_1", _config(task={"type": "chief", "index": 1}),
     "TF_CONFIG task.index", "1"),
    ("evaluator_index_1", _config(task={"type": "evaluator", "index": 1}),
     "TF_CONFIG task.index", "1"),
    # Other keys.
    ("rpc_layer_int", _config(rpc_layer=1), "TF_CONFIG rpc_layer", "1"),
    ("rpc_layer_empty", _config(rpc_layer=""), "TF_CONFIG rpc_layer", "''"),
    ("rpc_layer_url", _config(rpc_layer="grpc://"), "TF_CONFIG rpc_layer",
     "'grpc://'"),
    ("rpc_layer_null", _config(rpc_layer=None), "TF_CONFIG rpc_layer",
     "None"),
    ("environment_not_string", _config(environment=["cloud"]),
     "TF_CONFIG environment", "['cloud']"),
    ("session_master_not_string", _config(session_master=1),
     "TF_CONFIG session_master", "1"),
    # Past Python's own limits: a ConfigError, not a ValueError or
    # RecursionError from the JSON decoder or from printing the value.
    ("index_huge_int_text",
     '{"cluster": {"worker": ["w:1"]}, "task": {"type": "worker", "index": '
     + "9" * 5000 + "}}", "TF_CONFIG", "'{\"cluster\""),
    ("nested_100000_deep", "[" * 100_000, "TF_CONFIG", "'[[[["),
    ("index_huge_int", _Unprintable(_config(task=_worker(10 ** 5000))),
     "TF_CONFIG task.index", "int too large to print"),
    ("dense_job_huge_index",
     _Unprintable(_config({"worker": {10 ** 5000: "w:1"}})),
     "TF_CONFIG cluster.worker", "dict too large to print"),
)


@pytest.mark.beside
class ParseValidTest(parameterized.TestCase):

  @parameterized.named_parameters(*_VALID)
  def test_dict(self, config, cluster, task_type, task_id, rpc_layer):
    info = tf_config.parse_tf_config(config, source=_SOURCE)
    self._check(info, cluster, task_type, task_id, rpc_layer)

  @parameterized.named_parameters(*_VALID)
  def test_json_text(self, config, cluster, task_type, task_id, rpc_layer):
    info = tf_config.parse_tf_config(json.dumps(config), source=_SOURCE)
    self._check(info, cluster, task_type, task_id, rpc_layer)

  @parameterized.named_parameters(*_VALID)
  def test_round_trip(self, config, cluster, task_type, task_id, rpc_layer):
    del cluster, task_type, task_id, rpc_layer  # Compared with the first parse.
    info = tf_config.parse_tf_config(config, source=_SOURCE)
    text = tf_config.dump_tf_config(info)
    again = tf_config.parse_tf_config(text, source=_SOURCE)
    self.assertEqual(again, info)

  def _check(self, info, cluster, task_type, task_id, rpc_layer):
    self.assertIsInstance(info, ClusterInfo)
    self.assertEqual(info.source, "tf_config")
    self.assertEqual(info.origin, _SOURCE)
    self.assertEqual({job: list(addrs) for job, addrs in info.cluster.items()},
                     cluster)
    self.assertEqual(info.task_type, task_type)
    self.assertEqual(info.task_id, task_id)
    self.assertIs(type(info.task_id), int)
    self.assertEqual(info.rpc_layer, rpc_layer)

  def test_explicit(self):
    info = tf_config.parse_tf_config(_config(), source="the config argument",
                                     explicit=True)
    self.assertEqual(info.source, "explicit")
    self.assertEqual(info.origin, "the config argument")

  def test_default_source(self):
    info = tf_config.parse_tf_config(_config())
    self.assertEqual(info.origin, "TF_CONFIG from the environment")

  def test_does_not_modify_input(self):
    config = _config({"worker": {"1": "b:1", "0": "a:1"}}, _worker("1"))
    before = json.dumps(config)
    tf_config.parse_tf_config(config)
    self.assertEqual(json.dumps(config), before)

  def test_accepts_any_mapping(self):
    config = types.MappingProxyType(
        {"cluster": types.MappingProxyType({"worker": ("a:1", "b:1")}),
         "task": types.MappingProxyType({"type": "worker", "index": 1})})
    info = tf_config.parse_tf_config(config)
    self.assertEqual(info.address, "b:1")

  def test_cluster_info_properties(self):
    info = tf_config.parse_tf_config(_config(_PS_CLUSTER, _worker(1)))
    self.assertEqual(info.num_workers, 3)
    self.assertEqual(info.num_ps, 2)
    self.assertFalse(info.is_chief)
    self.assertEqual(info.address, "w1:2222")


@pytest.mark.beside
class ParseMalformedTest(parameterized.TestCase):

  @parameterized.named_parameters(*_MALFORMED)
  def test_config_error(self, config, field, received):
    with self.assertRaises(ConfigError) as cm:
      tf_config.parse_tf_config(config, source=_SOURCE)
    error = cm.exception
    self.assertEqual(error.field, field)
    self.assertEqual(error.source, _SOURCE)
    message = str(error)
    self.assertStartsWith(message, f"{field}: received ")
    self.assertIn(f"received {received}", message)
    self.assertIn(f"({_SOURCE})", message)
    self.assertNotEmpty(error.expected)

  def test_count(self):
    self.assertGreaterEqual(len(_MALFORMED), 45)
    self.assertGreaterEqual(len(_VALID), 12)

  def test_index_out_of_range_message(self):
    with self.assertRaises(ConfigError) as cm:
      tf_config.parse_tf_config(_config(_workers("a:1", "b:1"), _worker(3)))
    self.assertEqual(
        str(cm.exception),
        "TF_CONFIG task.index: received 3; expected an index below 2, the "
        "number of entries in cluster.worker (TF_CONFIG from the environment)")
    self.assertEqual(cm.exception.value, 3)

  @parameterized.named_parameters(
      ("truncated", '{"cluster": ', "line 1 column 13"),
      ("second_line", '{"cluster": {},\n "task": }', "line 2 column 10"),
  )
  def test_json_error_position(self, text, position):
    with self.assertRaisesRegex(ConfigError, position):
      tf_config.parse_tf_config(text)

  def test_error_types(self):
    with self.assertRaises(ConfigError) as cm:
      tf_config.parse_tf_config("{")
    self.assertIsInstance(cm.exception, TfdistError)
    self.assertIsInstance(cm.exception, ValueError)
    self.assertIsNone(cm.exception.__cause__)
    again = pickle.loads(pickle.dumps(cm.exception))
    self.assertEqual(str(again), str(cm.exception))

  @parameterized.named_parameters(("missing", {}, _MISSING),
                                  ("none", {"value": None}, "None"))
  def test_a_missing_value_stays_missing(self, given, said):
    # Through pickling and restated under a flag's name, as the CLI does.
    error = ConfigError(field="master_addr", expected="an address",
                        source="the API", **given)
    for again in (pickle.loads(pickle.dumps(error)),
                  error.restated(field="--master-addr", source="the CLI")):
      self.assertIn(f"received {said};", str(again))
      self.assertEqual(again.missing, not given)
      self.assertIsNone(again.value)

  def test_duplicate_address_names_first_use(self):
    with self.assertRaisesRegex(ConfigError, r"already used by cluster\.chief"
                                r"\[0\]"):
      tf_config.parse_tf_config(_config({"chief": ["h:1"], "worker": ["h:1"]}))


_JOBS = st.sampled_from(["chief", "worker", "ps", "evaluator", "boss", ""])
_HUGE = st.integers(4400, 6000).map(lambda n: 10 ** n)
_SCALAR = st.one_of(st.none(), st.booleans(), st.integers(), _HUGE,
                    st.floats(), st.text(max_size=12))
_ADDRESS = st.one_of(
    st.from_regex(r"\[?[a-zA-Z0-9.:_-]{0,12}\]?:[0-9]{0,6}", fullmatch=True),
    _SCALAR)
_ANY = st.recursive(_SCALAR, lambda inner: st.one_of(
    st.lists(inner, max_size=3),
    st.dictionaries(st.text(max_size=6), inner, max_size=3)), max_leaves=8)
_JOB = st.one_of(
    st.lists(_ADDRESS, max_size=4),
    st.dictionaries(st.one_of(st.integers(-1, 4), st.integers(-1, 4).map(str),
                              _HUGE), _ADDRESS, max_size=4),
    _ANY)
_TASK = st.one_of(st.fixed_dictionaries(
    {"type": st.one_of(_JOBS, _ANY),
     "index": st.one_of(st.integers(-2, 4), st.text("0123456789 -", max_size=5),
                        _ANY)},
    optional={"extra": _ANY}), _ANY)
#: TF_CONFIG-shaped documents: right keys, values of any type or size.
_DOCUMENTS = st.fixed_dictionaries(
    {"cluster": st.one_of(st.dictionaries(_JOBS, _JOB, max_size=4), _ANY),
     "task": _TASK},
    optional={"rpc_layer": _ANY, "environment": _ANY, "bogus": _ANY})


def _text(document) -> str:
  try:
    return json.dumps(document)
  except ValueError:  # An integer too long to print: write its digits.
    return '{"task": {"index": ' + "9" * 5000 + "}}"


#: TF_CONFIG texts: documents as JSON, cut short, nested deep, or any text.
_TEXTS = st.one_of(
    _DOCUMENTS.map(_text),
    st.tuples(_DOCUMENTS.map(_text), st.integers(0, 200)).map(
        lambda t: t[0][:t[1]]),
    st.integers(900, 200_000).map(lambda n: "[" * n),
    st.integers(900, 50_000).map(lambda n: '{"cluster": ' * n),
    st.text(max_size=40))


@pytest.mark.beside
class ParseGeneratedTest(absltest.TestCase):
  """Whatever TF_CONFIG holds: a ClusterInfo or a ConfigError, never else."""

  def _check(self, config):
    try:
      info = tf_config.parse_tf_config(config, source=_SOURCE)
    except ConfigError as e:
      self.assertStartsWith(str(e), "TF_CONFIG")
      self.assertIn(f"({_SOURCE})", str(e))
    else:
      self.assertIsInstance(info, ClusterInfo)

  @hypothesis.settings(max_examples=300, deadline=None)
  @hypothesis.given(_DOCUMENTS)
  def test_documents(self, document):
    self._check(document)

  @hypothesis.settings(max_examples=300, deadline=None)
  @hypothesis.given(_TEXTS)
  def test_texts(self, text):
    self._check(text)


@pytest.mark.beside
class FromEnvironTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("empty", {}),
      ("other_variables", {"PATH": "/bin", "TF_CONFIGURATION": "{}"}),
  )
  def test_unset_is_none(self, environ):
    self.assertIsNone(tf_config.from_environ(environ))

  def test_reads_tf_config(self):
    environ = types.MappingProxyType(
        {"TF_CONFIG": json.dumps(_config(task=_worker(1)))})
    info = tf_config.from_environ(environ)
    self.assertEqual(info.source, "tf_config")
    self.assertEqual(info.origin, "TF_CONFIG from the environment")
    self.assertEqual(info.task_type, "worker")
    self.assertEqual(info.task_id, 1)

  @parameterized.named_parameters(
      ("empty", "", "TF_CONFIG"),
      ("whitespace", "   ", "TF_CONFIG"),
      ("bad_json", "{cluster}", "TF_CONFIG"),
      ("bad_index", json.dumps(_config(task=_worker(5))),
       "TF_CONFIG task.index"),
  )
  def test_set_but_invalid(self, text, field):
    with self.assertRaises(ConfigError) as cm:
      tf_config.from_environ({"TF_CONFIG": text})
    self.assertEqual(cm.exception.field, field)
    self.assertIn("(TF_CONFIG from the environment)", str(cm.exception))


@pytest.mark.beside
class DumpTest(parameterized.TestCase):

  def test_dump_is_what_tensorflow_documents(self):
    info = tf_config.parse_tf_config(_config(task=_worker(1)))
    self.assertEqual(json.loads(tf_config.dump_tf_config(info)),
                     {"cluster": _CLUSTER, "task": {"type": "worker",
                                                    "index": 1}})

  def test_dump_keeps_rpc_layer(self):
    info = tf_config.parse_tf_config(_config(rpc_layer="grpc+verbs"))
    self.assertEqual(json.loads(tf_config.dump_tf_config(info))["rpc_layer"],
                     "grpc+verbs")

  @parameterized.named_parameters(
      ("local", ClusterInfo(source="local"), "ClusterInfo.task_type"),
      ("bad_cluster", ClusterInfo(source="slurm", cluster={"worker": ["w"]},
                                  task_type="worker", task_id=0),
       "TF_CONFIG cluster.worker[0]"),
      ("index_out_of_range", ClusterInfo(source="slurm",
                                         cluster={"worker": ["w:1"]},
                                         task_type="worker", task_id=1),
       "TF_CONFIG task.index"),
  )
  def test_dump_refuses_invalid(self, info, field):
    with self.assertRaises(ConfigError) as cm:
      tf_config.dump_tf_config(info)
    self.assertEqual(cm.exception.field, field)
    self.assertIn("dump_tf_config", cm.exception.source)


@pytest.mark.beside
class ImportTest(absltest.TestCase):

  def test_parsing_does_not_import_tensorflow(self):
    # Stub the packages so that only this module and what it imports run,
    # whatever the tfdist facade imports.
    code = f"""
import sys, types
for name, path in (("tfdist", "tfdist"), ("tfdist.cluster", "tfdist/cluster")):
  module = types.ModuleType(name)
  module.__path__ = [{_ROOT!r} + "/" + path]
  sys.modules[name] = module
from tfdist.cluster import tf_config
info = tf_config.parse_tf_config(
    '{{"cluster": {{"worker": ["a:1"]}}, '
    '"task": {{"type": "worker", "index": 0}}}}')
tf_config.dump_tf_config(info)
tf_config.from_environ({{}})
loaded = sorted(m for m in sys.modules
                if m.split(".")[0] in ("tensorflow", "keras"))
assert not loaded, loaded
print("ok")
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True,
                            text=True, timeout=60, check=False)
    self.assertEqual(result.returncode, 0, result.stderr)
    self.assertEqual(result.stdout.strip(), "ok")


if __name__ == "__main__":
  absltest.main()
