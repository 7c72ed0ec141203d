"""CUDA graphs over the split graph: the whole graph (full) or each piece (piecewise).

`manager.CudaGraphManager` plans which regions are captured; `capture.GraphCapture`, which it is,
owns the shared pool and captures; `runner.CudaGraphRunner` captures and replays one region per
capture size (`padding.py` pads a call to it); `stats.py` counts, `errors.py` names what goes wrong, `buffer_stores.py` refuses
forwards that assign module buffers while graphs read them in place.
Imports: the runtime modules beside it, compile, split, config.
"""
