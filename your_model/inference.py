"""Load a saved model.pt into a plain model on one device, and use it.

    python your_model/inference.py runs/single/model.pt runs/ddp/model.pt
"""
import sys

import torch
from single import Net, evaluate, make_data  # the model's code: the file holds only its weights

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
_, eval_set = make_data()
for path in sys.argv[1:]:
    model = Net().to(device)
    # strict: every name must match. A state_dict saved from the DDP wrapper itself names them "module.inp.weight".
    model.load_state_dict(torch.load(path, map_location=device, weights_only=True))
    model.eval()
    with torch.no_grad():
        first = model(eval_set[:5][0].to(device)).argmax(dim=1).tolist()
    correct, count = evaluate(model, eval_set, device)
    print(f"{path}: classes of the first 5 held-out samples {first}, accuracy {correct / count:.2%} ({count} samples)")
