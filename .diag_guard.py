import os, sys, traceback, torch, opsmath, transformers, sympy
import torch.fx.experimental.symbolic_shapes as ss
orig = ss.ShapeEnv._set_replacement
seen = set()
def spy(self, a, tgt, msg):
    if isinstance(tgt, sympy.Integer) and (str(a), int(tgt)) not in seen:
        seen.add((str(a), int(tgt)))
        st = traceback.format_stack()
        keep = [f for f in st if "/sympy/" not in f and "symbolic_convert" not in f and "eval_frame" not in f][-28:]
        print(f"DIAG replacement {a} -> {tgt} ({msg})\n" + "".join(keep), flush=True)
    return orig(self, a, tgt, msg)
ss.ShapeEnv._set_replacement = spy
torch._logging.set_logs(recompiles=True)
cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128, vocab_size=256)
dev = "cuda" if torch.cuda.is_available() else "cpu"
for inductor in (True,):
    torch._dynamo.reset(); seen.clear()
    print("=== inductor", inductor, flush=True)
    m = opsmath.optimize(transformers.LlamaForCausalLM(cfg).to(dev), inductor=inductor)
    for T in [16, 24, 40]:
        ids = torch.randint(0, 256, (2, T), device=dev)
        m(input_ids=ids, labels=ids).loss.backward()
    r = opsmath.report(m)
    print("RESULT inductor", inductor, [(g.dynamic, g.calls, len(g.matches)) for g in r.graphs], r.unoptimized_calls, flush=True)
