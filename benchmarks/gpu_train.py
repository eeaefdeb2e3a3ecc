"""The GPU benchmark's training job (benchmarks/bench_gpu.py): a transformer trained on one
GPU per worker over NCCL (``DEV=cpu``: on the CPU over gloo, for a dry run), saving every
EVERY steps; its first attempt SIGKILLs itself right after the save of step KILL returned.

Usage: gpu_train.py MODE STEPS KILL EVERY  (EVERY 0: never saves)
    MODE  rp: rallypoint.checkpoint, synchronous; rp-async: asynchronous;
          tr: torch.save to $CKPT_DIR/ckpt.pt, what a torchrun user writes
Environment: LAYERS (12: 151M parameters, 1.81 GB with AdamW), BATCH (16), DEV (cuda).

Prints ``READY`` once loaded (when, from where, the load's seconds) and one ``T`` line per
step: its compute time and how long the save held the loop up.
"""

import os
import sys
import time

import torch
import torch.distributed as dist

mode, steps, kill_at, every = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
began = time.time()
restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
device = os.environ.get("DEV", "cuda")
dist.init_process_group("nccl" if device == "cuda" else "gloo")
if device == "cuda":
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
torch.manual_seed(0)
layers = int(os.environ.get("LAYERS", "12"))
model = torch.nn.Sequential(
    *[
        torch.nn.TransformerEncoderLayer(1024, 16, 4096, batch_first=True, dropout=0.0)
        for _ in range(layers)
    ]
).to(device)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
start, source, load_seconds = 0, "none", 0.0
loading = time.perf_counter()
if mode.startswith("rp"):
    from rallypoint import checkpoint

    loaded = checkpoint.load_latest(map_location=device)
    if loaded is not None:
        model.load_state_dict(loaded.state["model"])
        optimizer.load_state_dict(loaded.state["optimizer"])
        start, source = loaded.step + 1, loaded.source
else:
    path = os.path.join(os.environ["CKPT_DIR"], "ckpt.pt")
    if os.path.exists(path):
        saved = torch.load(path, map_location=device, weights_only=True)
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        start, source = int(saved["step"]) + 1, "disk"
load_seconds = time.perf_counter() - loading
batch = torch.randn(int(os.environ.get("BATCH", "16")), 512, 1024, device=device)
sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
sync()
state_gb = sum(p.numel() * 4 * 3 for p in model.parameters()) / 1e9
print(
    f"READY {time.time():.3f} restart={restart} start={start} source={source} "
    f"setup={time.time() - began:.2f} load={load_seconds:.3f} state_gb={state_gb:.2f}",
    flush=True,
)
for step in range(start, steps):
    a = time.perf_counter()
    with torch.autocast(device, dtype=torch.bfloat16):
        loss = model(batch).float().pow(2).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    reduced = loss.detach().clone()
    dist.all_reduce(reduced)
    sync()
    b = time.perf_counter()
    if every and step % every == 0:
        state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
        if mode.startswith("rp"):
            checkpoint.save(state, step, asynchronous=mode == "rp-async")
        else:
            partial = path + ".tmp"
            torch.save({**state, "step": step}, partial)
            os.replace(partial, path)
    c = time.perf_counter()
    print(
        f"T {time.time():.3f} restart={restart} step={step} compute={b - a:.4f} stall={c - b:.4f}",
        flush=True,
    )
    if step == kill_at and restart == 0:
        os.kill(os.getpid(), 9)
if mode.startswith("rp"):
    checkpoint.wait()
dist.destroy_process_group()
