"""Performance options: how gradients cross the wire.

`with_gradient_options` gives a Keras optimizer gradient compression (fp16 or
bf16 on the wire, float32 everywhere else), all-reduce packing and a choice
of transport (TensorFlow's collectives, or tfdist's ring all-reduce over TCP
sockets, `tfdist.strategy.transport`); it works with Keras ``fit``,
`tfdist.fit` and `tfdist.Runner`. `accumulating_step` (for
the Runner) and `with_accumulation` (for ``fit``) accumulate k micro-batches
in float32 per all-reduce.
`docs/benchmarks.md` has what each option gains on this project's machines.
"""

from tfdist.perf.accumulation import accumulating_step
from tfdist.perf.accumulation import with_accumulation
from tfdist.perf.gradients import with_gradient_options
from tfdist.ring import SocketRing
from tfdist.strategy.gradient_options import COMPRESSIONS
from tfdist.strategy.gradient_options import Compression
from tfdist.strategy.gradient_options import GradientOptions
from tfdist.strategy.gradient_options import TRANSPORTS
from tfdist.strategy.gradient_options import get_compression
from tfdist.strategy.gradient_options import gradient_options_of
from tfdist.strategy.transport import close_transports

__all__ = ["COMPRESSIONS", "Compression", "GradientOptions", "SocketRing",
           "TRANSPORTS", "accumulating_step", "close_transports",
           "get_compression", "gradient_options_of", "with_accumulation",
           "with_gradient_options"]
