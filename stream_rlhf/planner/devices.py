"""What the analytic costs (`analytic.py`) know of a device: its rates, bandwidths and overheads.

    h100 = device_figures("h100,count=8")          # a preset with overrides (`plan --device`)
    h100.rate                                      # FLOP/s a matmul-bound pass reaches
    this = this_machine(shape, work, threads, cache_dir)   # micro_calibration.py: timed here

A *device* is what one rank runs on: a GPU, or on the CPU the cores of one side of a separated
placement. Preset figures are the vendors' dense bf16 peaks and memory / link bandwidths; the
efficiencies and per-layer overheads are assumptions (stated in `PRESETS`), not measurements:
say so when quoting a prediction made from them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Annotated

from msgspec import Meta

from stream_rlhf.config import ConfigError, build, check_fields
from stream_rlhf.strict_yaml import parse_yaml

GB = 1e9


@dataclass(frozen=True)
class DeviceFigures:
    """One device's figures (`plan --device NAME,key=value`: these fields are the keys)."""

    name: str
    """What the figures describe (a preset's name, or "this machine (...)")."""
    peak_flops: Annotated[float, Meta(gt=0)]
    """FLOP/s of a dense matmul at the device's peak (the precision of `bytes_per_param`)."""
    efficiency: Annotated[float, Meta(gt=0, le=1)] = 1.0
    """The fraction of `peak_flops` a forward or training pass reaches (MFU)."""
    bandwidth: Annotated[float, Meta(gt=0)] = 1e12
    """Device memory bandwidth, bytes/s: a memory-bound decode step reads every weight once."""
    layer_overhead_s: Annotated[float, Meta(ge=0)] = 0.0
    """Fixed seconds per layer of a forward pass (kernel launches, Python); a training pass costs
    three times a forward's."""
    decode_overhead_s: Annotated[float, Meta(ge=0)] = 0.0
    """Fixed seconds per layer of one decode step (with CUDA graphs: close to nothing)."""
    bytes_per_param: Annotated[int, Meta(ge=1)] = 2
    """Bytes of one weight as the stages hold and send it (2: bf16, 4: fp32)."""
    link_bandwidth: Annotated[float, Meta(gt=0)] = 1e11
    """Bytes/s between two devices (gradient all-reduce, weight publish to rollout)."""
    host_bandwidth: Annotated[float, Meta(gt=0)] = 5e10
    """Bytes/s between a device and host memory (offload and onload)."""
    memory_gb: Annotated[float, Meta(gt=0)] = 80.0
    """Memory of one device."""
    count: Annotated[int, Meta(ge=1)] = 1
    """Devices of the job."""
    dp_efficiency: Annotated[float, Meta(gt=0, le=1)] = 0.9
    """The fraction of linear speed-up a stage's compute keeps when split over several ranks (the
    gradients' all-reduce is costed apart, over `link_bandwidth`)."""

    def __post_init__(self) -> None:
        check_fields(self)

    @property
    def rate(self) -> float:
        """FLOP/s a pass reaches: peak x efficiency."""
        return self.peak_flops * self.efficiency

    def describe(self) -> str:
        return (f"{self.name}: {self.rate / 1e12:.4g} TFLOP/s ({self.efficiency:.0%} of {self.peak_flops / 1e12:.4g}), "
                f"memory {self.bandwidth / GB:.4g} GB/s, link {self.link_bandwidth / GB:.4g} GB/s, "
                f"{self.count} device(s) of {self.memory_gb:g} GB")


PRESETS = {
    # dense bf16 peaks and HBM / NVLink / PCIe bandwidths from the data sheets; efficiency 0.4 (a
    # typical training MFU), 10 us per layer of a forward (fused kernels), 2 us per layer of a
    # decode step (CUDA graphs): assumptions
    "h100": DeviceFigures("h100", peak_flops=989e12, efficiency=0.4, bandwidth=3.35e12, layer_overhead_s=1e-5,
                          decode_overhead_s=2e-6, bytes_per_param=2, link_bandwidth=450e9, host_bandwidth=55e9,
                          memory_gb=80.0),
    "a100": DeviceFigures("a100", peak_flops=312e12, efficiency=0.4, bandwidth=2.0e12, layer_overhead_s=1e-5,
                          decode_overhead_s=2e-6, bytes_per_param=2, link_bandwidth=300e9, host_bandwidth=25e9,
                          memory_gb=80.0),
}


def device_figures(spec: str) -> DeviceFigures:
    """`NAME[,key=value...]`: a preset (`PRESETS`) with fields overridden, e.g. "h100,count=8" or
    "a100,efficiency=0.5,memory_gb=40"; ConfigError naming what is wrong (values are YAML, checked
    as a config's are)."""
    name, *overrides = [part.strip() for part in spec.split(",")]
    if name not in PRESETS:
        raise ConfigError(f"--device {spec}: {name!r} is not a preset ({', '.join(PRESETS)})")
    values = asdict(PRESETS[name])
    for override in overrides:
        key, _, text = override.partition("=")
        if key == "name" or key not in values or not text:
            raise ConfigError(f"--device {spec}: {override!r} is not key=value of "
                              f"{', '.join(k for k in values if k != 'name')}")
        values[key] = parse_yaml(text)
    values["name"] = name + "".join(f",{o}" for o in overrides)
    try:
        return build(DeviceFigures, values, "device")
    except ConfigError as exc:
        raise ConfigError(f"--device {spec}: {exc}") from None
