"""Where sexpgpu.tn's GPU sweep spends its time (torch.profiler), beside src-method. Run on a GPU."""
import sys, time, numpy as np, torch
sys.path.insert(0, "benches")
import sexpgpu.tn as tn
from tn_gpu import random_mpo, perturbed_identity, inner
import src_method
from torch.profiler import profile, ProfilerActivity

n, chi, dtype = 20, 500, "complex128"
rng = np.random.default_rng(0)
a, b = random_mpo(n, chi, rng, dtype), perturbed_identity(n, rng, dtype)
for _ in range(2):
    tn.apply(a, b, chi, seed=1, device="gpu"); src_method.apply(a, b, chi, seed=1, device="gpu")
torch.cuda.synchronize()
t = time.perf_counter(); tn.apply(a, b, chi, seed=1, device="gpu"); torch.cuda.synchronize(); print("ours", time.perf_counter() - t)
t = time.perf_counter(); src_method.apply(a, b, chi, seed=1, device="gpu"); torch.cuda.synchronize(); print("src-method", time.perf_counter() - t)
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    tn.apply(a, b, chi, seed=1, device="gpu"); torch.cuda.synchronize()
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60))
print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25, max_name_column_width=60))
import cProfile, pstats
pr = cProfile.Profile(); pr.enable(); tn.apply(a, b, chi, seed=1, device="gpu"); torch.cuda.synchronize(); pr.disable()
pstats.Stats(pr).sort_stats("cumulative").print_stats(30)
