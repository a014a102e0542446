import torch

# tiny test models are dominated by per-op overhead; one thread avoids spin-waiting between the two cores
torch.set_num_threads(1)
