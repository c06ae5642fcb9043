"""``fibos``: one command line for the local launcher, deployment helpers, benchmarks and analyses.

Each subcommand hands its arguments to the module that implements it (``fibos bench --help`` shows
that module's options), so a subcommand behaves exactly as the module's own ``main``. The table
below is the only place that lists them; modules are imported only when their subcommand runs.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from importlib import import_module

import click
import typer

#: subcommand -> (module whose ``main(argv)`` runs it, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "local": (
        "cli.launcher",
        "Run a federation on this machine (SuperLink + SuperNodes, or the Simulation Engine)",
    ),
    "bench": (
        "benchmarks.benchmark",
        "Methods side by side on the same data, partitions, seeds and capacities",
    ),
    "bench-structured": (
        "benchmarks.structured_bench",
        "Client cost: physically smaller (CA-HFP) vs masked models",
    ),
    "bench-wallclock": (
        "benchmarks.wallclock_bench",
        "Wall-clock time to accuracy with slow nodes (sync vs async)",
    ),
    "bench-vs-flower": (
        "benchmarks.vs_flower.comparison",
        "Time to accuracy against a stock Flower FedAvg app on the same nodes, data and initial "
        "weights",
    ),
    "bench-poisoning": (
        "benchmarks.poisoning_bench",
        "How far one client can move another's Fisher-ranked mask",
    ),
    "bench-leak": (
        "benchmarks.privacy.leak_bench",
        "Which classes a node holds, read by a curious server from its Fisher upload or its update",
    ),
    "bench-dp-price": (
        "benchmarks.privacy.dp_price",
        "What dp-epsilon costs in accuracy: per-seed table and plot from finished bench results",
    ),
    "bench-secagg": (
        "benchmarks.privacy.secagg_bytes",
        "What a node would upload if its masked update went through Flower's SecAgg+",
    ),
    "bench-fisher-memory": (
        "benchmarks.fisher_memory_bench",
        "Server memory of the per-client Fisher state",
    ),
    "bench-server": (
        "benchmarks.server_bench",
        "Server seconds per round at scale, step by step, against numpy",
    ),
    "bench-selection": (
        "benchmarks.ranking.selection_quality",
        "How close the server's mask is to the exact-Fisher one, per estimator and upload encoding",
    ),
    "bench-refresh": (
        "benchmarks.ranking.refresh_options",
        "Ways to rank a small client's next mask at the global model: bytes, and what each keeps "
        "of the exact mask",
    ),
    "bench-fisher-cost": (
        "benchmarks.fisher_cost_bench",
        "A client's Fisher estimate and upload encoding, timed against its local training",
    ),
    "bench-text-recipe": (
        "benchmarks.text_recipe_bench",
        "Which optimiser and step size fine-tune a pretrained text model (central training, per "
        "recipe)",
    ),
    "class-coverage": (
        "benchmarks.class_coverage",
        "Per-class recall and dead units of finished runs",
    ),
    "ranking-rules": (
        "benchmarks.ranking.ranking_rules",
        "Submodels of a finished run's global model under each ranking rule (Fisher, magnitude, "
        "...)",
    ),
    "docs": (
        "cli.docs_reference",
        "Check (or --write) the docs generated from the code: config, methods, layout",
    ),
    "check-gpu": (
        "cli.gpu_check",
        "The client paths on a CUDA GPU against the CPU (training, Fisher, LoRA, probe, a "
        "federation); a report",
    ),
    "credentials": (
        "cli.credentials",
        "Make a CA, the SuperLink certificate and SuperNode key pairs",
    ),
    "control": ("cli.control", "Register SuperNode keys and submit runs through the Control API"),
    "join": ("cli.join", "Make a key pair, register it and start a SuperNode on this machine"),
}

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="fibos-fl: Fisher-ranked submodels for heterogeneous Flower federations.",
)


@contextmanager
def subcommand_argv(name: str, args: Sequence[str]) -> Iterator[list[str]]:
    """Within the block, ``sys.argv`` reads as the subcommand line typed: ``["fibos <name>",
    *args]``.

    argparse names the program after ``sys.argv[0]`` (``usage: fibos local ...``, not ``usage:
    fibos``), and the run-folder lock records ``sys.argv`` as the command holding the folder.

    Parameters
    ----------
    name : str
        The subcommand.
    args : Sequence[str]
        Its arguments; the block gets them as a list, to hand to the module's ``main``.
    """
    saved = sys.argv
    sys.argv = [f"fibos {name}", *args]
    try:
        yield list(args)
    finally:
        sys.argv = saved


def _register(name: str, module: str, help_text: str) -> None:
    def command(ctx: typer.Context) -> None:
        run = import_module(module).main
        with subcommand_argv(name, ctx.args) as args:
            code = run(args)
        raise typer.Exit(int(code or 0))

    # Options go to the module's own parser, --help included.
    settings = {"allow_extra_args": True, "ignore_unknown_options": True, "help_option_names": []}
    app.command(name, help=help_text, context_settings=settings, add_help_option=False)(command)


for _name, (_module, _help) in COMMANDS.items():
    _register(_name, _module, _help)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``fibos`` script (and ``python -m cli.fibos``)."""
    try:
        # Outside standalone mode click returns a command's exit status instead of raising it.
        code = app(
            args=list(sys.argv[1:] if argv is None else argv),
            prog_name="fibos",
            standalone_mode=False,
        )
    except typer.Exit as done:
        return int(done.exit_code)
    except (
        click.ClickException
    ) as err:  # an unknown subcommand, or none: click's message or the help
        err.show()
        return err.exit_code
    except (
        SystemExit
    ) as done:  # argparse's --help and usage errors (printed already), or sys.exit("message")
        if isinstance(
            done.code, str
        ):  # Python prints such a message and exits 1; so must this entry point
            print(done.code, file=sys.stderr)
            return 1
        return int(done.code or 0)
    return int(code or 0)


if __name__ == "__main__":
    sys.exit(main())
