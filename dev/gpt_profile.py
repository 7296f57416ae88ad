"""Where a cuda training step of GPT-2 small spends its GPU time (torch.profiler)."""
import sys, tempfile, time
from pathlib import Path
import numpy as np, torch
sys.path.insert(0, "benches")
from cuda_gpt import GPT
from sexpgpu.lang import load_experiment_text
from sexpgpu.ir.compile import compile_run
from sexpgpu.devices.cuda.device import CudaDevice
from sexpgpu.runtime.devices import Device
from torch.profiler import profile, ProfilerActivity

text = GPT.format(layers=12, width=768, heads=12, seq=1024, vocab=50257, batch=8, microbatches=1, steps=10, dtype="bf16")
ex = load_experiment_text(text, "gpt.lisp"); c = compile_run(ex, ex.run())
prog = CudaDevice("cuda").load(c, Device("cuda", 0))
prog.start(ex.run().optimizer, seed=1, state=None)
rng = np.random.default_rng(0)
t = rng.integers(0, 256, (8, 1025)).astype(np.int32)
batch = {"tokens": t[:, :-1], "next": t[:, 1:]}
class Ctx: size = 1; rank = 0
def step():
    prog.accumulate(batch); prog.reduce(Ctx(), 1); prog.update(1e-4, 1.0)
for _ in range(3): step()
torch.cuda.synchronize()
t0 = time.perf_counter()
for _ in range(5): step()
torch.cuda.synchronize(); print("step ms", (time.perf_counter() - t0) / 5 * 1e3)
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
    step(); torch.cuda.synchronize()
print(p.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=70))
