"""What a cross-datacenter link carries for the KV channel.

TCP over a lossy path is held to the Mathis et al. ceiling per connection, MSS / RTT x C / sqrt(p) with
C = sqrt(3/2) (Mathis, Semke, Mahdavi, Ott, "The Macroscopic Behavior of the TCP Congestion Avoidance Algorithm",
CCR 1997). The KV channel opens `streams` connections per pull (serving.kv_streams), so a pull gets
min(link bandwidth, streams x ceiling). With no loss, or no RTT, the formula sets no ceiling and the link
bandwidth is the limit. Loss-based congestion control is the assumption; BBR-style senders do better on lossy paths.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

MATHIS_C = math.sqrt(1.5)
DEFAULT_MSS_BYTES = 1448  # 1500-byte MTU less IP and TCP headers with timestamps: what crosses regions


@dataclass(frozen=True)
class LinkSpec:
    bandwidth_gbps: float
    rtt_ms: float
    loss_pct: float = 0.0
    streams: int = 4
    mss_bytes: int = DEFAULT_MSS_BYTES

    def __post_init__(self) -> None:
        for name in ("bandwidth_gbps", "rtt_ms", "loss_pct"):
            if getattr(self, name) < 0:
                raise ValueError(f"link {name} must not be negative, got {getattr(self, name)}")
        if self.bandwidth_gbps == 0:
            raise ValueError("link bandwidth_gbps must be positive")
        if not 0 <= self.loss_pct < 100:
            raise ValueError(f"link loss_pct must be in [0, 100), got {self.loss_pct}")
        if self.streams < 1 or self.mss_bytes < 1:
            raise ValueError("link streams and mss_bytes must be at least 1")

    @property
    def mathis_gbps_per_stream(self) -> float | None:
        """The TCP ceiling of one connection, or None when loss or RTT is zero (no ceiling from the formula)."""
        # a subnormal loss_pct or rtt_ms underflows to 0 here: no ceiling either
        probability, rtt_s = self.loss_pct / 100, self.rtt_ms / 1e3
        if probability == 0 or rtt_s == 0:
            return None
        return self.mss_bytes * 8 / rtt_s * MATHIS_C / math.sqrt(probability) / 1e9

    @property
    def effective_gbps(self) -> float:
        """What one KV pull over `streams` connections gets, and what the link carries for the KV channel."""
        ceiling = self.mathis_gbps_per_stream
        return self.bandwidth_gbps if ceiling is None else min(self.bandwidth_gbps, self.streams * ceiling)

    def transfer_seconds(self, nbytes: float) -> float:
        """Serialisation time of `nbytes` at the effective rate (the RTTs of the pull are counted by the caller)."""
        return nbytes * 8 / (self.effective_gbps * 1e9)
