"""(bench/gpu/check.sh runs it on the GPU.) What a GPU's runtime holds outside a program's
values, for the cost model's `reserved` and `fragmentation` (passes/src/planner/cost/presets.rs,
GPU_RESERVED and GPU_FRAGMENTATION, assumed until this measures them):
- the CUDA context (device memory in use after the first allocation, less that allocation),
- the cuBLAS handle and workspace (after the first matrix products, fp32 and bf16),
- an NCCL communicator (a one-rank process group and an all-reduce),
- the caching allocator's margin in training: torch.cuda.max_memory_reserved over
  max_memory_allocated for 5 steps of nanoGPT's GPU config (torch_user.py's model,
  eager fp32), and the same for GPT-2 124M at batch 8.
Prints one line per figure, in MiB; `reserved` is the sum of the first three."""
import os, sys, torch, torch.distributed as dist

MIB = 1 << 20


def used():
    free, total = torch.cuda.mem_get_info()
    return total - free


torch.cuda.init()
x = torch.ones(1, device="cuda")
torch.cuda.synchronize()
context = used() - torch.cuda.memory_reserved()
print(f"memory: CUDA context {context / MIB:.0f} MiB")
base = used()
a = torch.randn(4096, 4096, device="cuda")
(a @ a).sum().item()
(a.bfloat16() @ a.bfloat16()).sum().item()
del a
torch.cuda.empty_cache()
cublas = used() - base - torch.cuda.memory_reserved()
print(f"memory: cuBLAS handle and workspace {max(cublas, 0) / MIB:.0f} MiB")
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("MASTER_PORT", "29533")
base = used()
try:
    dist.init_process_group("nccl", rank=0, world_size=1)
    t = torch.ones(1 << 20, device="cuda")
    dist.all_reduce(t)
    torch.cuda.synchronize()
    del t
    torch.cuda.empty_cache()
    nccl = used() - base - torch.cuda.memory_reserved()
    print(f"memory: NCCL communicator (one rank) {max(nccl, 0) / MIB:.0f} MiB")
    dist.destroy_process_group()
except Exception as e:  # noqa: BLE001 - report and go on
    nccl = 0
    print(f"memory: NCCL communicator: not measured ({e})")
print(f"memory: reserved (sum) {(context + max(cublas, 0) + max(nccl, 0)) / MIB:.0f} MiB")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import importlib  # noqa: E402
for args, name in (([], "nanoGPT GPU config"), (["--gpt2"], "GPT-2 124M batch 8")):
    # torch_user.py reads its sizes from argv when imported.
    sys.argv = [sys.argv[0]] + args
    sys.modules.pop("torch_user", None)
    u = importlib.import_module("torch_user")
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    torch.manual_seed(0)
    m = u.GPT().to("cuda")
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    xs = torch.randint(0, u.V, (u.B, u.T), device="cuda")
    for _ in range(5):
        loss = m(xs, xs)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    alloc, res = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
    print(f"memory: {name}: peak allocated {alloc / MIB:.0f} MiB, reserved {res / MIB:.0f} MiB, "
          f"allocator margin {100 * (res / alloc - 1):.1f}%")
    del m, opt, xs, loss
