"""64 x 1024-token fresh prefills, max_tokens=1: through generate, and stepping the engine by hand."""
import os, random, sys, time
import torch
try:
    from nanoplug.bench.throughput import default_checkpoint_dir, write_checkpoint
except ImportError:
    from nanoplug.bench import default_checkpoint_dir, write_checkpoint
from nanoplug import LLM, SamplingParams
llm = LLM(str(write_checkpoint()), attention="flash", kv_cache="triton", max_model_len=4096, enable_prefix_caching=False)
rng = random.Random(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
sp = SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=1)
def prompts():
    return [[rng.randrange(1000, 100000) for _ in range(1024)] for _ in range(64)]
llm.generate(prompts(), sp, use_tqdm=False); torch.cuda.synchronize()
gen, manual = [], []
for _ in range(5):
    ps = prompts(); t = time.perf_counter(); llm.generate(ps, sp, use_tqdm=False); gen.append(time.perf_counter() - t)
    e = llm.engine
    reqs = [e.make_request(p, sp) for p in prompts()]
    t = time.perf_counter()
    for r in reqs: e.add_request(r)
    done = 0
    while done < len(reqs):
        done += sum(1 for u in e.step() if u.finished)
    manual.append(time.perf_counter() - t)
    while e.has_unfinished(): e.step()
print(os.environ.get("TAG"), "generate ms:", " ".join(f"{x*1000:.1f}" for x in gen), "| by hand ms:", " ".join(f"{x*1000:.1f}" for x in manual))
