"""What to build where the process runs: the `tf.distribute.Strategy`.

Names load on first use, so importing this face costs nothing: the
``catalog`` and ``options`` modules and ``from tfdist.strategy import
startup`` (the start-up watcher's helper process) never load TensorFlow.
One module per concept:

| module       | concept                                                      |
|--------------|--------------------------------------------------------------|
| `catalog`    | what each strategy accepts, written once (TensorFlow-free)   |
| `options`    | the frozen options dataclass of each builder                 |
| `factory`    | `make_strategy`: the builders and the ``auto`` rule          |
| `tpu`        | the TPU builder                                              |
| `startup`    | the bound on cluster start-up                                |
| `server`     | ps and worker tasks serving a parameter-server chief         |
| `introspect` | the one reading of a running strategy (task, chief, workers) |
| `clean_exit` | multi-worker tasks leave together at a clean exit (bounded)  |
| `transport`  | what carries the gradients: TensorFlow's collectives or the socket ring (`tfdist.ring`); the facade of the five below |
| `transport_choice` | which transport, and why: the ``auto`` rule, the workers' agreement, the chief's line |
| `gradient_hook` | the Keras hook's body: each optimizer's gradients summed by its transport |
| `rings`      | the socket rings of a strategy's workers: made once, closed at exit |
| `buckets`    | the socket all-reduce: buckets summed while the backward pass goes on |
| `packing`    | a bucket's gradients packed for the ring, their sums returned without a copy |
| `timeline`   | when each step's backward pass and each gradient bucket ran (the bench) |
| `keras_hooks` | what `make_strategy` installs on Keras: the gradient hook, chief-aware callbacks |
| `keras_callbacks` | Keras's writing callbacks: one writer per path (the chief) |
"""

from tfdist import _lazy

__all__ = ["OPTION_CLASSES"]

#: The frozen options dataclass of each builder (`tfdist.strategy.options`).
OPTION_CLASSES = ("DefaultOptions", "OneDeviceOptions", "MirroredOptions",
                  "MultiWorkerMirroredOptions", "ParameterServerOptions",
                  "CentralStorageOptions", "TPUOptions")

_EXPORTS = {
    "StrategySpec": "tfdist.strategy.catalog",
    "CATALOG": "tfdist.strategy.catalog",
    "STRATEGY_NAMES": "tfdist.strategy.catalog",
    **dict.fromkeys(OPTION_CLASSES, "tfdist.strategy.options"),
    "make_strategy": "tfdist.strategy.factory",
    "choose_strategy": "tfdist.strategy.factory",
    "options_for": "tfdist.strategy.factory",
    "bounded_startup": "tfdist.strategy.startup",
    "start_server": "tfdist.strategy.server",
    "serve": "tfdist.strategy.server",
    "task_of": "tfdist.strategy.introspect",
    "is_chief": "tfdist.strategy.introspect",
    "is_parameter_server": "tfdist.strategy.introspect",
    "num_workers": "tfdist.strategy.introspect",
    "num_input_workers": "tfdist.strategy.introspect",
}

_lazy.install(globals(), _EXPORTS)
