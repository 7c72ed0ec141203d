"""What the bench scripts share: the table they print, GPU timing (CUDA graphs replayed in interleaved
rounds, ratios to a floor and to a baseline), and the memory-bandwidth floor's denominator.

Every script prints Markdown tables through `print_table`; a ratio "x floor" is a time over the time
the bytes a step must move take at `copy_bandwidth()` (device-to-device, read + write bytes)."""
from __future__ import annotations

import statistics

import torch


def print_table(header, rows) -> None:
    """A Markdown table, cells right-aligned."""
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    line = lambda cells: "| " + " | ".join(str(c).rjust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    print(line(header))
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in rows:
        print(line(r))


def copy_bandwidth(nbytes: int = 1 << 30) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written."""
    src = torch.randn(nbytes // 2, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(10):
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * nbytes / statistics.median(times)


def capture(fn):
    """fn captured in a CUDA graph after two warm-up calls on a side stream; returns (graph, output)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def replay_ms(graph, replays: int = 20) -> float:
    """ms per replay (CUDA events around `replays` back-to-back replays, after one more)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / replays


def interleaved(graphs: dict, rounds: int, replays: int = 20) -> dict[str, list[float]]:
    """ms per replay of each graph, one sample per round, the graphs taking turns in every round."""
    times = {name: [] for name in graphs}
    for _ in range(rounds):
        for name, graph in graphs.items():
            times[name].append(replay_ms(graph, replays))
    return times


def ratio_cells(times: dict[str, list[float]], name: str, base: str, floor_ms: float) -> list[str]:
    """ms (median), x floor, x the base variant, and the spread of the rounds."""
    ms = statistics.median(times[name])
    return [f"{ms:.3f}", f"{ms / floor_ms:.2f}", f"{ms / statistics.median(times[base]):.3f}",
            f"{min(times[name]):.3f}-{max(times[name]):.3f}"]


def model_arguments(parser, *, layers: int, hidden: int, heads: int, vocab: int, batch: int, seq: int) -> None:
    """The decoder-size options the training and host-cost benchmarks share, with each one's defaults."""
    for name, default in (("layers", layers), ("hidden", hidden), ("heads", heads), ("vocab", vocab),
                          ("batch", batch), ("seq", seq)):
        parser.add_argument(f"--{name}", type=int, default=default)
