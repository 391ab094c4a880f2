"""Every command of the CLI, registered on import (one module per group of commands)."""

from . import (  # noqa: F401  # imported to register their commands
    answer,
    bench,
    bench_drafting,
    bench_gpu,
    bench_serving,
    bench_users,
    calibrate,
    evaluate,
    models,
    score,
    serve,
)
