"""The `slimfit` command: `demo` (plain vs slimfit fine-tuning), `memory` (saved-activation report of an
architecture), `plan` (a step's peak memory predicted before the run; both in slimfit/memory/cli.py), `env`
(versions, backends, devices)."""
from __future__ import annotations

import argparse
import platform
import sys


def _env(_args) -> int:
    import torch

    import slimfit
    from slimfit.kernels import backend_info

    rows = [
        ("slimfit", slimfit.__version__),
        ("python", platform.python_version()),
        ("platform", platform.platform()),
        ("torch", f"{torch.__version__} (CUDA build: {torch.version.cuda or 'no'})"),
    ]
    try:
        import triton

        rows.append(("triton", triton.__version__))
    except Exception as exc:  # not installed, or broken
        rows.append(("triton", f"unavailable ({type(exc).__name__})"))
    try:
        import transformers

        rows.append(("transformers", transformers.__version__))
    except Exception:
        rows.append(("transformers", "not installed"))
    info = backend_info()
    rows.append(("backend requested", info["requested"] + "  (SLIMFIT_BACKEND)"))
    rows.append(("CPU kernels", info["cpu"]))
    if info["native_error"]:
        rows.append(("native load error", info["native_error"]))
    threads = torch.get_num_threads()
    threads_row = str(threads)
    if info["cpu"].startswith("native"):
        import slimfit._C as native

        used = native.cpu_threads_used()
        fix = "" if used == threads else "; rebuild with OpenMP: the extension runs serially"
        threads_row += f" (native kernels use {used}{fix})"
    rows.append(("CPU threads", threads_row))
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            rows.append((f"cuda:{i}", f"{p.name}, {p.total_memory / 2**30:.1f} GiB, sm_{p.major}{p.minor}"))
        rows.append(("CUDA kernels (extension)", ", ".join(info["cuda_extension_ops"]) or "none"))
        rows.append(("CUDA kernels (Triton)", ", ".join(info["cuda_triton_ops"]) or "none"))
        if info["triton_error"]:
            rows.append(("triton load error", info["triton_error"]))
    else:
        rows.append(("CUDA devices", "none"))
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="slimfit", description="Fine-tune transformers in less memory.")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("env", help="print versions, kernel backends and devices").set_defaults(func=_env)
    demo = sub.add_parser("demo", help="fine-tune MiniLM on Rotten Tomatoes, plain vs slimfit, side by side")
    from .demo.main import add_arguments, run

    add_arguments(demo)
    demo.set_defaults(func=run)
    from .memory.cli import COMMANDS

    for command in COMMANDS:  # `slimfit memory` and `slimfit plan`: one flag vocabulary (slimfit/memory/cli.py)
        command_parser = sub.add_parser(command.name, help=command.help)
        command.add_arguments(command_parser)
        command_parser.set_defaults(func=command.run)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
