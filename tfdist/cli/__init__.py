"""The ``tfdist`` command line: `main` and one module per subcommand.

| module   | subcommand                                          |
|----------|-----------------------------------------------------|
| `main`   | ``tfdist`` itself: the registry and the error rule  |
| `launch` | ``tfdist launch``                                   |
| `slurm`  | ``tfdist slurm``                                    |
| `info`   | ``tfdist info``                                     |
| `bench`  | ``tfdist bench``                                    |
| `_args`  | the conventions they share (flags, ``--``, errors)  |

Only ``python -m tfdist`` and the ``tfdist`` console script import this
package; the library never does.
"""

# Console scripts installed before 0.2.0 call tfdist.cli:console_main.
from tfdist.cli.main import console_main

__all__ = ["console_main"]
