"""How long a run takes to plan, cold or warm: the cuda lowering on PyTorch's CPU device.

    python3 dev/warm_start.py FILE [--variant V] [--set NAME=VALUE ...] [--profile OUT.prof]

Times a process from its start (imports included) to a run planned and
loaded (`prepare_run`), with the compile cache the environment names
(``SEXPGPU_CACHE``, ``XDG_CACHE_HOME``): run it twice on one cache to
see a cold and a warm start. Prints the report's stacking and fused lines.
`--profile` writes cProfile's numbers of `prepare_run` to a file.
"""

import time

began = time.perf_counter()

import argparse  # noqa: E402
import cProfile  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("file", type=Path)
    parser.add_argument("--variant")
    parser.add_argument("--set", dest="sets", action="append", default=[])
    parser.add_argument("--profile")
    args = parser.parse_args()
    from device_seam import device_named

    from sexpgpu.devices.cuda.device import CudaDevice
    from sexpgpu.train import prepare_run

    imported = time.perf_counter()
    profile = cProfile.Profile() if args.profile else None
    with device_named("cpu", CudaDevice("cpu", fuse=True)):
        if profile:
            profile.enable()
        start = time.perf_counter()
        trainer = prepare_run(
            args.file, variant=args.variant, sets=args.sets, out=Path("/tmp") / f"warm-start-{os.getpid()}"
        )
        done = time.perf_counter()
        if profile:
            profile.disable()
            profile.dump_stats(args.profile)
    for line in trainer.report:
        if line.startswith(("fused:", "stacking", "memory:")):
            print(line)
    print(
        f"imports {imported - began:.1f} s, prepare_run {done - start:.1f} s, "
        f"total {done - began:.1f} s"
    )


if __name__ == "__main__":
    main()
