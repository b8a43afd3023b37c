# SPDX-License-Identifier: MIT
"""The process's weft World: init, finalize, teams, and the registry of what must be closed collectively."""
import atexit
import hashlib
import os
import sys
import threading

from . import _weft
from ._weft import Error
from ._weft import refuse_inside_signal_handler as _refuse_inside_signal_handler


class _State:
    """One World per process, the objects made on it (closed in creation order by finalize), its heap blocks."""

    def __init__(self, world, group_ranks, store_adapter, options=None):
        self.world = world
        self.pid = os.getpid()  # the process that made the World (a forked child inherits the state, not the World)
        # init's settings as this World's init was given them (0: from the environment), for a later init's check
        self.options = dict(options or {})
        self.num_ranks = world.num_ranks  # a plain int: what torch.compile reads while tracing weft.torch's ops
        self.group_ranks = group_ranks  # torch global rank of each weft rank (None: not built on torch)
        self.store_adapter = store_adapter
        self.objects = []  # ops and buffers, creation order
        self.heap_blocks = {}  # pointer -> bytes, for weft.empty tensors not freed yet
        self.op_cache = {}  # functional ops' cached fused-op objects
        self.teams = []  # weft.Team objects by index (a handle's low bits: _TEAM_INDEX_BITS)
        self.call_context = None  # _tensor.CallContext, made by the first op call
        global _worlds_made
        _worlds_made += 1
        self.generation = _worlds_made  # a handle's high bits: a handle of a finalized World is refused


_state = None
_lock = threading.Lock()
_worlds_made = 0  # Worlds this process made (_State.generation)
# The dead-peer bound of a World on torch's store where WEFT_DEAD_PEER_MS is not set (weft's own stores: 10 s).
_TORCH_STORE_DEAD_PEER_MS = 60000
_TEAM_INDEX_BITS = 20  # Team.handle = generation << _TEAM_INDEX_BITS | index in the World's teams
_init_count = {}  # key prefix base -> Worlds made on it by this process (the same count on every rank)


def _torch_distributed():
    """torch.distributed when torch is imported and a default process group exists, else None."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    dist = torch.distributed
    if not dist.is_available() or not dist.is_initialized():
        return None
    return dist


def _in_group(dist, group):
    """Whether this rank is a member of torch process group `group`. A rank outside a torch group holds None or
    GroupMember.NON_GROUP_MEMBER, whose ranks torch does not know (it may even answer another group's)."""
    return (group is not None and group is not getattr(dist.GroupMember, "NON_GROUP_MEMBER", object())
            and dist.get_rank(group) >= 0)


def _device_index(device):
    """init's `device` as a CUDA device index, or None for the default (_default_device): an int, "cuda[:N]" or a
    torch.device of type cuda. "cuda" and torch.device("cuda") without an index are the default too (this rank's GPU),
    not the device 0 that torch.cuda.current_device() reports in a process that has not called set_device."""
    if device is None:
        return None
    if isinstance(device, int) and not isinstance(device, bool):
        if device < 0:
            raise ValueError(f"device: expected a CUDA device index >= 0, got {device}")
        return device
    torch = sys.modules.get("torch")
    if isinstance(device, str) or (torch is not None and isinstance(device, torch.device)):
        if torch is None:
            kind, colon, index = device.partition(":")
            if kind != "cuda" or (colon and not index.isdigit()):
                raise ValueError(f"device: expected 'cuda' or 'cuda:N', got {device!r}")
            return int(index) if colon else None
        try:
            d = torch.device(device)
        except RuntimeError as e:
            raise ValueError(f"device: {e}") from None
        if d.type != "cuda":
            raise ValueError(f"device: expected a CUDA device, got {device!r}")
        return d.index
    raise TypeError(f"device: expected a CUDA device index (int), 'cuda:N' or a torch.device, got "
                    f"{type(device).__name__}")


def _default_device():
    """The device of init's default (device None, "cuda"): torch's current device once torch has initialised CUDA
    (set_device, tensors), else -1: the World takes LOCAL_RANK's GPU (modulo the visible devices), not the device 0
    that current_device() reports in every process before that."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.current_device()
    return -1


def init(group=None, *, device=None, heap_bytes=0, sm_budget=0, timeout_ms=0):
    """Creates this process's weft World (collective over the World's ranks) and returns it.

    With torch.distributed initialised, the World's ranks are those of `group` (default: the default process group)
    and it meets through torch's store (World::from_store, keys under a prefix of weft's own; no second port);
    ranks outside `group` get None. Without torch.distributed, the ranks come from the launcher's environment
    (weftrun, torchrun, mpirun, srun: World::from_env). `device`: the CUDA device (None, "cuda" or
    torch.device("cuda"): torch's current device once torch has initialised CUDA, else LOCAL_RANK modulo the visible
    devices). heap_bytes, sm_budget, timeout_ms: 0 = from the environment (WEFT_SYMMETRIC_HEAP_BYTES, WEFT_SM_BUDGET,
    WEFT_TIMEOUT_MS), else weft's defaults.
    Calling init again returns the existing World (weft.finalize first to make another); a `group` whose ranks are
    not the existing World's, a `device` that is not its device, or a non-zero heap_bytes, sm_budget or timeout_ms
    that is not its setting, is a ValueError. A World closed by its own close() counts as none: init makes a new one.
    In a process forked after weft.init, init raises weft.Error (the World is the parent's).
    """
    global _state
    _refuse_inside_signal_handler("weft.init")
    device = _device_index(device)
    options = {"heap_bytes": heap_bytes, "sm_budget": sm_budget, "timeout_ms": timeout_ms}
    with _lock:
        if _forked_from is not None:
            raise _forked_error("weft.init")
        _drop_closed_world()
        dist = _torch_distributed()
        if group is not None and dist is None:
            raise ValueError("group: a process group needs torch.distributed to be initialised first")
        # A group made with use_local_synchronization=True is None on the ranks outside it, which here means the
        # default group: such a rank must not call init with it (docs/python.md).
        if group is not None and not _in_group(dist, group):
            return None
        if _state is not None:
            if dist is not None and (group is not None or _state.group_ranks is not None):
                ranks = (list(dist.get_process_group_ranks(group)) if group is not None
                         else list(range(dist.get_world_size())))
                if ranks != _state.group_ranks:
                    mine = _state.group_ranks if _state.group_ranks is not None else "of the launcher"
                    which = "group has" if group is not None else "the default group (group=None) has"
                    raise ValueError(f"weft.init: weft is initialised already, over torch ranks {mine}; {which} "
                                     f"ranks {ranks}: call weft.finalize() first to make a World over another group")
            if device is not None and device != _state.world.device:
                raise ValueError(f"weft.init: weft is initialised already, on device {_state.world.device}; got "
                                 f"device {device}: call weft.finalize() first to make a World on another device")
            _check_same_options(_state, options)
            return _state.world
        if device is None:
            device = _default_device()
        if dist is None:
            world = _weft.World.from_env(device=device, heap_bytes=heap_bytes, sm_budget=sm_budget,
                                         timeout_ms=timeout_ms)
            _state = _State(world, None, None, options)
        else:
            ranks = list(dist.get_process_group_ranks(group)) if group is not None else list(
                range(dist.get_world_size()))
            me = dist.get_rank()
            if me not in ranks:
                return None
            base = "weft/" + (hashlib.sha1(",".join(map(str, ranks)).encode()).hexdigest()[:16]
                              if group is not None else "world")
            count = _init_count.get(base, 0)
            _init_count[base] = count + 1
            adapter = _weft.StoreAdapter(dist.distributed_c10d._get_default_store())
            # The watchdog's heartbeats go through torch's store, a Python object: each needs this process's GIL, so
            # a rank whose main thread holds the GIL for seconds (a long C call) goes silent. Its peers wait longer
            # for it than on weft's own store (WEFT_DEAD_PEER_MS, when set, still decides).
            dead_peer_ms = 0 if "WEFT_DEAD_PEER_MS" in os.environ else _TORCH_STORE_DEAD_PEER_MS
            world = _weft.World.from_store(adapter, rank=ranks.index(me), num_ranks=len(ranks),
                                           key_prefix=f"{base}/{count}", device=device, heap_bytes=heap_bytes,
                                           sm_budget=sm_budget, timeout_ms=timeout_ms, dead_peer_ms=dead_peer_ms)
            _state = _State(world, ranks, adapter, options)
        return _state.world


_OPTION_ENV = {"heap_bytes": "WEFT_SYMMETRIC_HEAP_BYTES", "sm_budget": "WEFT_SM_BUDGET", "timeout_ms": "WEFT_TIMEOUT_MS"}


def _check_same_options(state, options):
    """A later init's explicit (non-zero) heap_bytes, sm_budget and timeout_ms against the live World's: each must be
    its setting (as the World reports it, as its init was given it, or as the environment gave it to an init that
    passed 0: the World may round or clamp it); a heap_bytes the World's heap holds passes. Else ValueError naming the
    setting and both values."""
    for name, value in options.items():
        if value == 0 or value == state.options.get(name):
            continue
        if state.options.get(name, 0) == 0 and os.environ.get(_OPTION_ENV[name], "").strip() == str(value):
            continue
        live = getattr(state.world, name)
        if value != live and not (name == "heap_bytes" and value <= live):
            asked = state.options.get(name, 0)
            given = f" (its weft.init was given {asked})" if asked not in (0, live) else ""
            raise ValueError(f"weft.init: weft is initialised already, with {name} {live}{given}; got {name} {value}: "
                             f"call weft.finalize() first to make a World with another {name}")


def _drop_closed_world():
    """Forgets a World closed by its own close() (weft.world().close()), as weft.finalize would have: weft is then not
    initialised, and init makes a new World. Called with _lock held. (World.close() refuses while an op or buffer made
    on the World is open, so nothing in the registry is left open by this.)"""
    global _state
    if _state is not None and _state.world.closed:
        _state = None


def finalize():
    """Collective: closes every op, buffer and handle still open (newest first, the same order on every rank),
    then the World; its symmetric heap, and so every weft.empty tensor not yet freed, goes with it. A no-op when
    weft is not initialised, and in a process forked after weft.init (the World is the parent's). Registered with
    atexit when weft is imported: it runs before the interpreter tears down torch.distributed's objects (the store the
    World's last barrier goes through). Call it yourself before torch.distributed.destroy_process_group()."""
    global _state
    _refuse_inside_signal_handler("weft.finalize")
    with _lock:
        state, _state = _state, None
    if state is None:
        return
    if state.pid != os.getpid():  # forked without os.fork's handlers (_after_fork_in_child): the parent's World
        _disown(state)
        return
    # At exit after an uncaught exception this rank is leaving on an error: its peers may be inside a call with it,
    # waiting on the device for what it will not send. Abort first: they stop at their next heartbeat, this rank
    # named, instead of at their timeout (the closes and the World's last barrier below still meet them).
    uncaught = _uncaught
    # (an interactive interpreter reports each statement's error through sys.excepthook and goes on: not there)
    if uncaught is not None and _exiting and not hasattr(sys, "ps1") and not state.world.closed:
        try:
            state.world.abort(f"it is exiting on an uncaught exception: {type(uncaught).__name__}: {uncaught}")
        except Exception:  # noqa: BLE001 -- closing follows all the same
            pass
    first_error = None
    for obj in reversed(list(state.objects)):  # the newest first: handles before the buffers they came from
        try:
            obj.close()
        except BaseException as e:  # noqa: BLE001 -- the others are closed all the same; the first error is raised
            # (a KeyboardInterrupt too; a World left open would be closed by its destructor, where no signal handler
            # runs). One from a weft wait aborted the World; one that came in Python code did not: abort it here, or
            # this rank's next closes would meet its peers' closes of the object it skipped (a hang or mismatched
            # frees). On an aborted World the closes after it end at once.
            if not isinstance(e, Exception) and not state.world.closed and not state.world.aborted:
                try:
                    state.world.abort(f"finalize was interrupted by {type(e).__name__}")
                except Exception:  # noqa: BLE001 -- closing follows all the same
                    pass
            first_error = first_error or e
    state.objects.clear()
    state.op_cache.clear()
    state.heap_blocks.clear()
    try:
        # Closed whatever the objects did: a World left open would keep the peers waiting at its shutdown barrier. It
        # refuses (weft.Error) only while an object made outside weft's registry is still open.
        state.world.close()
    finally:
        if first_error is not None:
            raise first_error


_exiting = False
_uncaught = None  # the exception that ended the main thread, seen by sys.excepthook (not one handled earlier)
_previous_excepthook = sys.excepthook


def _excepthook(exc_type, exc, tb):
    global _uncaught
    _uncaught = exc
    _previous_excepthook(exc_type, exc, tb)


sys.excepthook = _excepthook


def _finalize_at_exit():
    global _exiting
    _exiting = True
    finalize()


atexit.register(_finalize_at_exit)

# ---- fork ----
# A child forked after weft.init inherits the World's Python objects, but the World is the parent's: its rank, its
# store connection (a socket the two processes now share) and its GPU context (CUDA cannot be used in a child forked
# from a process that initialised it). Closing it there (finalize, the exit hook, a destructor) would run the
# parent's collective closes and last barrier over the parent's store, in the parent's name.
_forked_from = None  # in a process forked after weft.init: the pid of the process whose World it inherited


def _disown(state):
    """Leaves `state` (its World, ops, buffers, teams) to this process's exit untouched: no close, and no destructor
    (a World's or an op's would close it collectively), not even while the interpreter finalises."""
    global _forked_from
    _forked_from = state.pid
    import ctypes
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(state))  # a reference nobody drops: what it holds is never freed


def _after_fork_in_child():
    global _state, _lock
    _lock = threading.Lock()  # a thread of the parent may have held it at the fork; that thread is not here
    state, _state = _state, None
    if state is not None:
        _disown(state)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _forked_error(what):
    return Error(f"{what}: this process was forked from process {_forked_from} after weft.init there, and that "
                 "World (its rank, its store connection, its GPU context) is the parent's: a forked child cannot use "
                 "it, nor CUDA. Start the child with multiprocessing's 'spawn' start method (or exec a new program) "
                 "and call weft.init in it if it needs weft")


def is_initialized():
    """Whether this process has a live World: False before weft.init, after weft.finalize or the World's own close(),
    and in a process forked after weft.init (the World is the parent's)."""
    state = _state
    return state is not None and not state.world.closed


def _get_state():
    """The state, else weft.Error (not initialised; a forked process). Reads no attribute of the C++ World:
    torch.compile traces it (weft.torch's team lookups). A World closed by its own close() is seen here only by the
    op calls, which the World refuses ("this World is closed"); _live_state drops it first."""
    state = _state
    if state is None:
        if _forked_from is not None:
            raise _forked_error("weft")
        raise Error("weft is not initialised: call weft.init() first (after torch.distributed.init_process_group, "
                    "when you use it)")
    return state


def _live_state():
    """_get_state, once a World closed by its own close() is forgotten (weft is then not initialised)."""
    state = _state
    if state is not None and state.world.closed:
        with _lock:
            _drop_closed_world()
    return _get_state()


def world():
    """The process's World (weft._weft.World: rank, num_ranks, device, barrier(), ...)."""
    return _live_state().world


def rank():
    return _live_state().world.rank


def num_ranks():
    return _live_state().world.num_ranks


def _register(obj):
    _get_state().objects.append(obj)
    return obj


def _unregister(obj):
    state = _state
    if state is not None and obj in state.objects:
        state.objects.remove(obj)


class Team:
    """An ordered subset of the World's ranks: Team([0, 2]) or Team(process_group).

    Collective over every rank of the World, in the same order of calls. Every member passes the same list; ranks may
    pass different lists (each its own group, e.g. its tensor-parallel group), which then make one team each; a list
    that not all of its members passed is a weft.Error on the members that passed it. The members agree through the
    World's store (Team::split_color). A rank outside its list (or outside the process group: torch hands such a rank
    None or GroupMember.NON_GROUP_MEMBER, both taken as "not a member") gets a team with is_member False. Ranks are weft World ranks; with a torch process group they are translated from torch's global
    ranks (torch.distributed.get_process_group_ranks).
    """

    def __init__(self, ranks):
        state = _live_state()
        n = state.world.num_ranks
        if not isinstance(ranks, (list, tuple, range)):
            dist = _torch_distributed()
            if dist is None:
                raise TypeError("ranks: expected a list of ranks or a torch.distributed process group, got "
                                f"{type(ranks).__name__}")
            if _in_group(dist, ranks):  # else this rank takes part as a non-member
                global_ranks = dist.get_process_group_ranks(ranks)
                try:
                    ranks = [state.group_ranks.index(r) if state.group_ranks is not None else r for r in global_ranks]
                except ValueError:
                    raise ValueError("ranks: the process group has ranks outside weft's World") from None
            else:
                ranks = []
        else:
            ranks = list(ranks)
            if not ranks:
                raise ValueError("ranks: expected at least one rank")
        for r in ranks:
            if not isinstance(r, int) or isinstance(r, bool) or not 0 <= r < n:
                raise ValueError(f"ranks: expected World ranks in [0, {n}), got {r!r}")
        if len(set(ranks)) != len(ranks):
            raise ValueError(f"ranks: expected distinct ranks, got {ranks}")
        me = state.world.rank
        if me in ranks:
            # One colour per list: ranks that pass different lists (each its own group) make different teams.
            digest = hashlib.sha1(",".join(map(str, ranks)).encode()).digest()
            color, key = int.from_bytes(digest[:4], "little") & 0x3FFFFFFF, ranks.index(me)
        else:
            color, key = -1, 0
        self._team = state.world.team().split_color(color, key)
        if self._team.is_member and list(self._team.members) != ranks:
            raise Error(f"Team: this rank passed ranks {ranks}, but the ranks that passed the same list are "
                        f"{list(self._team.members)}: every member of a team must pass its list, in the same order")
        self.ranks = ranks
        # Fixed for the team's life, read by every op call: membership, and the C++ team the ops take (None for a
        # team of every rank in order, which runs as the World's own ops).
        self._is_member = self._team.is_member
        self._cpp = None if ranks == list(range(n)) else self._team
        self._id = self._team.id
        self._state = state  # the World it belongs to: after weft.finalize the team is refused, not used
        # The integer weft.torch's custom ops take: the World's generation and this process's index of the team.
        self.handle = (state.generation << _TEAM_INDEX_BITS) | len(state.teams)
        state.teams.append(self)

    @property
    def rank(self):
        """This rank's index in the team, -1 for a non-member."""
        return self._team.rank

    @property
    def num_ranks(self):
        return len(self.ranks)

    @property
    def is_member(self):
        return self._is_member

    @property
    def is_world(self):
        return self._cpp is None

    @property
    def id(self):
        """The team's name, the same on every member and unique in the World."""
        return self._id

    def barrier(self):
        """Collective over the members."""
        _check_open(self, "Team.barrier")
        self._team.barrier()

    def __repr__(self):
        return f"weft.Team(ranks={self.ranks}, rank={self.rank})"


def team_by_handle(handle):
    """The weft.Team with this handle (Team.handle), or None for -1 (the World)."""
    if handle < 0:
        return None
    state = _get_state()
    generation, index = handle >> _TEAM_INDEX_BITS, handle & ((1 << _TEAM_INDEX_BITS) - 1)
    if generation != state.generation:
        raise Error(f"team: handle {handle} names a team of a World that was closed (weft.finalize or World.close()); "
                    "make the team again after weft.init (and trace or capture again what used it)")
    if index >= len(state.teams):
        raise Error(f"team: no weft.Team has handle {handle} in this World")
    return state.teams[index]


def team_size(handle):
    """Ranks of the team with this handle (-1: the World's)."""
    team = team_by_handle(handle)
    return team.num_ranks if team is not None else _get_state().num_ranks


def _team_for(team, op):
    """(World, the C++ team, or None for the World's own) for an op on `team` (a weft.Team or None: the World)."""
    state = _get_state()
    if team is None:
        return state.world, None
    return state.world, _cpp_team(team, op, state)


def _check_open(team, op):
    """Raises weft.Error when `team` belongs to a World that is closed (weft.finalize, World.close()), or to the
    parent's World in a forked process."""
    if team._state is not _state:
        if _forked_from is not None:
            raise _forked_error(op)
        raise Error(f"{op}: {team!r} belongs to a World that was closed (weft.finalize or World.close()); make the "
                    "team again after weft.init")


def _cpp_team(team, op, state):
    """The C++ team an op on `team` (a weft.Team) runs on, None for the World's own; raises for a non-member."""
    if not isinstance(team, Team):
        raise TypeError(f"team: expected a weft.Team or None, got {type(team).__name__}")
    _check_open(team, op)
    if not team._is_member:
        raise Error(f"{op}: world rank {state.world.rank} is not a member of {team!r}")
    return team._cpp
