"""What a volunteer server is asked to do: every option of ``python -m swarm.server``, as one value.

Its own module so that the modules the server is built from (placement, moves, the tail's drafter)
read it without importing the server's life cycle (server/span_server.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from protocol.limits import (
    DEFAULT_MAX_POSITIONS_PER_STEP,
    DEFAULT_MAX_SESSIONS,
    DEFAULT_MAX_SESSIONS_PER_PEER,
    DEFAULT_MAX_SHARE_PER_ADDRESS,
    DEFAULT_MAX_TRAIN_MIB,
    DEFAULT_MAX_UNREAD_MIB,
)
from server.batching import DEFAULT_GATHER_WINDOW
from server.compile_budget import PER_ADDRESS, PER_PEER, TOTAL, CompileBudget, check_limits
from server.joining import JOIN_JITTER, JOIN_SETTLE
from server.tail_drafter import DEFAULT_TAIL_DRAFTS


@dataclass(frozen=True)
class ServerConfig:
    model: str
    initial_peers: Sequence[str] = ()
    new_swarm: bool = False
    blocks: Optional[tuple[int, int]] = None
    num_blocks: Optional[int] = None
    host: str = "0.0.0.0"
    port: int = 0
    announce_maddrs: Sequence[str] = ()
    device: str = "auto"  # auto: cuda when available, else cpu
    dtype: str = "auto"  # auto: bfloat16 on CUDA, float32 on the CPU
    quant: str = "auto"  # none|int8|nf4; auto: server.quantization.default_quant
    public_name: Optional[str] = None
    cache_tokens: Optional[int] = None
    identity_path: Optional[str] = None
    update_period: float = 15.0  # seconds between DHT refreshes; records live 3x as long
    session_timeout: float = 600.0
    compression: str = "none"
    torch_threads: Optional[int] = None
    dht_prefix: Optional[str] = None
    drain_seconds: float = 30.0  # on shutdown or a move, open sessions get this long to finish
    balance_period: float = 120.0  # seconds between checks whether another span helps the swarm more
    # a self-placing server's join (server/joining.py): the most seconds of random wait before it reads the
    # swarm, and the seconds between announcing JOINING and reading it again
    join_jitter: float = JOIN_JITTER
    join_settle: float = JOIN_SETTLE
    assume_free_memory: Optional[int] = None  # bytes that stand in for the device's free memory in the plan
    max_positions_per_step: int = DEFAULT_MAX_POSITIONS_PER_STEP  # a Step's positions; frames sized by it
    max_sessions: int = DEFAULT_MAX_SESSIONS  # open sessions at most
    max_sessions_per_peer: int = DEFAULT_MAX_SESSIONS_PER_PEER  # open sessions per upstream peer at most
    max_share_per_address: float = DEFAULT_MAX_SHARE_PER_ADDRESS  # of slots and cache, per source address
    cap_loopback: bool = False  # count loopback clients per address too (server/address_caps.py)
    max_session_tokens: Optional[int] = None  # one session's max_length at most; None: a fair share of the budget
    max_unread_mib: int = DEFAULT_MAX_UNREAD_MIB  # results held for clients that have not read them (server/unread.py)
    max_train_mib: int = DEFAULT_MAX_TRAIN_MIB  # span inputs kept for training steps in flight (server/training.py)
    max_backward_mib: int = 0  # one training row's backward activations at most; 0: a row of max_positions_per_step
    reachability: str = "auto"  # auto: ask initial peers to dial back; public; private (always through a relay)
    drafter: str = "auto"  # the tail's drafter: auto (the committed drafter for this model, if any), none, or a file
    drafter_tokens: int = DEFAULT_TAIL_DRAFTS  # ids the tail drafts per run at most
    max_batch_positions: Optional[int] = (
        None  # positions of one batched pass; None: what the memory plan's headroom holds
    )
    gather_window: float = DEFAULT_GATHER_WINDOW  # seconds a ready batch waits for more runs
    batching: bool = True  # False: one run per pass through the span (for comparisons)
    revision: Optional[str] = None  # a hub model's commit, branch or tag; None: the one the swarm serves, else main
    adapters: tuple[str, ...] = ()  # PEFT LoRA adapters (folders or hub repos) this server serves (server/lora.py)
    compile_budget_per_peer: int = PER_PEER  # a tail's fresh constraint compiles per minute per requesting peer
    compile_budget_per_address: int = PER_ADDRESS  # ... per source address group
    compile_budget_total: int = TOTAL  # ... whoever asks (server/compile_budget.py)

    def __post_init__(self) -> None:
        # refused at start, by flag name, rather than at the first constrained session
        check_limits(self.compile_budget_per_peer, self.compile_budget_per_address, self.compile_budget_total)

    def compile_budget(self) -> CompileBudget:
        """The tail's ration of fresh constraint compiles (server/compile_budget.py)."""
        return CompileBudget(self.compile_budget_per_peer, self.compile_budget_per_address, self.compile_budget_total)

    def train_plan(self) -> tuple[int, int, int]:
        """What the memory plan counts for training steps (server/memory.py ``plan_blocks``)."""
        return self.max_train_mib, self.max_positions_per_step, self.max_backward_mib

    def train_limits(self) -> dict[str, int]:
        """The training bounds of the session handler (server/train_budget.py), in bytes."""
        return dict(max_train_bytes=self.max_train_mib << 20, max_backward_bytes=self.max_backward_mib << 20)
