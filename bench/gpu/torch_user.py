"""(bench/gpu/check.sh runs it on the GPU.) What a user would run instead: nanoGPT's GPU config (6 layers, 6 heads, 384 wide, block 256,
batch 64, vocab 65, no dropout) as nn.Module with PyTorch's own fast paths.
Prints the median step time (fwd + bwd + clip + AdamW) for: eager fp32 (TF32 off, SDPA),
eager bf16 autocast + fused AdamW, and torch.compile bf16 (if time allows)."""
import math, statistics, time, sys, torch, torch.nn as nn, torch.nn.functional as F
L, H, D, T, B, V = 6, 6, 384, 256, 64, 65
if "--gpt2" in sys.argv: L, H, D, T, B, V = 12, 12, 768, 1024, 8, 50257
dev = "cuda"
class Block(nn.Module):
    def __init__(s):
        super().__init__()
        s.ln1, s.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        s.qkv, s.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)
        s.fc, s.out = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)
    def forward(s, x):
        b, t, _ = x.shape
        q, k, v = s.qkv(s.ln1(x)).split(D, dim=2)
        q, k, v = (z.view(b, t, H, D // H).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + s.proj(y.transpose(1, 2).contiguous().view(b, t, D))
        return x + s.out(F.gelu(s.fc(s.ln2(x))))
class GPT(nn.Module):
    def __init__(s):
        super().__init__()
        s.wte, s.wpe = nn.Embedding(V, D), nn.Embedding(T, D)
        s.blocks = nn.ModuleList(Block() for _ in range(L)); s.lnf = nn.LayerNorm(D)
        s.head = nn.Linear(D, V, bias=False)
    def forward(s, idx, tgt):
        x = s.wte(idx) + s.wpe(torch.arange(idx.shape[1], device=idx.device))
        for b in s.blocks: x = b(x)
        logits = s.head(s.lnf(x))
        return F.cross_entropy(logits.view(-1, V), tgt.view(-1))
def bench(name, bf16, compile_, fused, runs=20):
    torch.manual_seed(0)
    m = GPT().to(dev)
    f = torch.compile(m) if compile_ else m
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1, fused=fused)
    x = torch.randint(0, V, (B, T), device=dev); y = torch.randint(0, V, (B, T), device=dev)
    def one():
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
            loss = f(x, y)
        opt.zero_grad(set_to_none=True); loss.backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0); opt.step()
    t0 = time.time()
    for _ in range(3): one()
    torch.cuda.synchronize(); warm = time.time() - t0
    ts = []
    for _ in range(runs):
        t = time.perf_counter(); one(); torch.cuda.synchronize(); ts.append(time.perf_counter() - t)
    med = statistics.median(ts)
    print(f"user-torch {name}: step {med*1e3:.3f} ms  ({B*T/med:.0f} tok/s; warm-up {warm:.1f} s)", flush=True)
def main():
    torch.backends.cuda.matmul.allow_tf32 = False; torch.backends.cudnn.allow_tf32 = False
    print(torch.__version__, torch.cuda.get_device_name(0), flush=True)
    bench("eager fp32 (TF32 off, SDPA)", False, False, False)
    torch.backends.cuda.matmul.allow_tf32 = True; torch.backends.cudnn.allow_tf32 = True
    bench("eager fp32 TF32 on (SDPA)", False, False, False)
    bench("eager bf16 autocast + fused AdamW", True, False, True)
    if "--compile" in sys.argv:
        bench("torch.compile bf16 + fused AdamW", True, True, True)
if __name__ == "__main__":
    main()
