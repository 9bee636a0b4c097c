import sys, time, pickle, glob, gc
import torch.distributed.checkpoint.metadata  # noqa
p = glob.glob(sys.argv[1] + "/**/.metadata", recursive=True)[0]
data = open(p, "rb").read()
if sys.argv[2] == "nogc": gc.disable()
t0, c0 = time.perf_counter(), time.process_time()
pickle.loads(data)
print(f"{sys.version.split()[0]} plain {sys.argv[2]} wall {time.perf_counter()-t0:.2f} cpu {time.process_time()-c0:.2f}", gc.get_stats()[2])
