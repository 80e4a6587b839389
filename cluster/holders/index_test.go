package holders

import (
	"encoding/hex"
	"fmt"
	"os/exec"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/messages"
)

var (
	t0    = time.Unix(1_000_000, 0)
	lease = 10 * time.Second
)

func stored(ns string, group int, hashes ...string) messages.KVEvent {
	return messages.KVEvent{Type: messages.KVBlockStored, BlockHashes: hashes, GroupIdx: group, Medium: messages.MediumCPU, Namespace: ns}
}

func removed(ns string, group int, hashes ...string) messages.KVEvent {
	ev := stored(ns, group, hashes...)
	ev.Type = messages.KVBlockRemoved
	return ev
}

func batch(evs ...messages.KVEvent) messages.KVEventBatch { return messages.KVEventBatch{Events: evs} }

func key(t *testing.T, h string, g int) messages.Key {
	raw, err := hex.DecodeString(h)
	require.NoError(t, err)
	return KeyOf(raw, g)
}

func apply(t *testing.T, x *Index, node, boot string, evs ...messages.KVEvent) {
	t.Helper()
	_, err := x.applyPlain(node, boot, "e-"+node, batch(evs...))
	require.NoError(t, err)
}

func TestHoldersPerNamespaceAndGroup(t *testing.T) {
	x := New(lease, 0)
	_, err := x.Heartbeat("a", "a1", t0)
	require.NoError(t, err)
	_, err = x.Heartbeat("b", "b1", t0)
	require.NoError(t, err)
	apply(t, x, "a", "a1", stored("m", 0, "aa", "bb"), stored("m", 1, "aa"))
	apply(t, x, "b", "b1", stored("m", 0, "bb"), stored("other", 0, "cc"))

	require.Equal(t, []string{"a"}, x.Holders(".m", key(t, "aa", 0), t0))
	require.Equal(t, []string{"a"}, x.Holders(".m", key(t, "aa", 1), t0))
	require.Equal(t, []string{"a", "b"}, x.Holders(".m", key(t, "bb", 0), t0))
	// Namespaces never match (PROTOCOL.md Isolation: lookup is per namespace).
	require.Empty(t, x.Holders(".m", key(t, "cc", 0), t0))
	require.Equal(t, []string{"b"}, x.Holders(".other", key(t, "cc", 0), t0))
	require.True(t, x.HeldElsewhere(".m", key(t, "bb", 0), "a", t0))
	require.False(t, x.HeldElsewhere(".m", key(t, "aa", 0), "a", t0))

	apply(t, x, "a", "a1", removed("m", 0, "bb"))
	require.Equal(t, []string{"b"}, x.Holders(".m", key(t, "bb", 0), t0))
}

// An event without a namespace is in the engine's namespace (the default).
func TestNamespaceDefaultsToTheEngine(t *testing.T) {
	x := New(lease, 0)
	_, _ = x.Heartbeat("a", "a1", t0)
	_, err := x.applyPlain("a", "a1", "e7", batch(stored("", 0, "aa")))
	require.NoError(t, err)
	require.Equal(t, []string{"a"}, x.Holders("e7", key(t, "aa", 0), t0))
}

// An engine's own namespace (named by default or outright, announced on its
// own kv_events) is not the shared namespace of that name another engine
// announces: a squatter naming engine vic's id as its namespace never
// counts vic's keys, nor vic the squatter's (messages.NamespaceKey).
func TestAnEnginesOwnNamespaceIsNotASharedOneOfItsName(t *testing.T) {
	x := New(lease, 0)
	_, _ = x.Heartbeat("a", "a1", t0)
	_, _ = x.Heartbeat("b", "b1", t0)
	_, err := x.applyPlain("a", "a1", "vic", batch(stored("vic", 0, "aa"), stored("", 0, "bb")))
	require.NoError(t, err)
	_, err = x.applyPlain("b", "b1", "mal", batch(stored("vic", 0, "cc")))
	require.NoError(t, err)
	own, shared := messages.NamespaceKey("vic", ""), messages.NamespaceKey("mal", "vic")
	require.NotEqual(t, own, shared)
	require.Equal(t, []string{"a"}, x.Holders(own, key(t, "aa", 0), t0))
	require.Equal(t, []string{"a"}, x.Holders(own, key(t, "bb", 0), t0))
	require.Empty(t, x.Holders(own, key(t, "cc", 0), t0))
	require.Equal(t, []string{"b"}, x.Holders(shared, key(t, "cc", 0), t0))
	require.Empty(t, x.Holders(shared, key(t, "aa", 0), t0))
}

// Only host memory counts: a node's disk-tier events (medium DISK) neither
// add nor remove a holder, since fetches are served from host memory.
func TestDiskTierEventsAreSkipped(t *testing.T) {
	x := New(lease, 0)
	_, _ = x.Heartbeat("a", "a1", t0)
	disk := func(ev messages.KVEvent) messages.KVEvent { ev.Medium = messages.MediumDisk; return ev }
	apply(t, x, "a", "a1", stored("m", 0, "aa"), disk(stored("m", 0, "bb")))
	require.Equal(t, []string{"a"}, x.Holders(".m", key(t, "aa", 0), t0))
	require.Empty(t, x.Holders(".m", key(t, "bb", 0), t0), "on disk only: not fetchable")
	apply(t, x, "a", "a1", disk(removed("m", 0, "aa")))
	require.Equal(t, []string{"a"}, x.Holders(".m", key(t, "aa", 0), t0), "a disk deletion leaves host memory's copy")
}

// A disk tier's clear (medium DISK: at each namespace's first register in
// a boot on a node with --disk-dir) says nothing of host memory either: it
// drops none of the node's keys and asks for no catch-up. Before, any
// engine opening a new namespace there made every other node forget all of
// that node's keys, every tenant's, until it had paged them again.
func TestDiskTierClearsAreSkipped(t *testing.T) {
	x := New(lease, 0)
	_, _ = x.Heartbeat("a", "a1", t0)
	apply(t, x, "a", "a1", stored("m", 0, "aa"), stored("n", 0, "bb"))
	res, err := x.applyPlain("a", "a1", "e", batch(messages.KVEvent{Type: messages.KVAllBlocksCleared, Medium: messages.MediumDisk, Namespace: "n"}))
	require.NoError(t, err)
	require.False(t, res.Cleared)
	require.Equal(t, []string{"a"}, x.Holders(".m", key(t, "aa", 0), t0))
	require.Equal(t, []string{"a"}, x.Holders(".n", key(t, "bb", 0), t0))
}

// A node's host-memory clear names one namespace (its reconnect's
// re-announce, a namespace's deferred changes dropped past their bound):
// only its keys in that namespace go. The contract's clear at an engine's
// first register names none and leaves the node's pool as it was: it drops
// nothing. Before, either dropped every key of the node, every tenant's,
// until a catch-up had paged them again (red team).
func TestAClearDropsOnlyTheNamespaceItNames(t *testing.T) {
	x := New(lease, 3)
	_, _ = x.Heartbeat("a", "a1", t0)
	_, _ = x.Heartbeat("b", "b1", t0)
	apply(t, x, "a", "a1", stored("m", 0, "aa", "bb"), stored("n", 0, "cc"))
	apply(t, x, "b", "b1", stored("m", 0, "aa"))
	res, err := x.applyPlain("a", "a1", "e", batch(stored("n", 0, "dd")))
	require.NoError(t, err)
	require.Equal(t, 1, res.OverCap, "a at its cap")

	res, err = x.applyPlain("a", "a1", "e", batch(messages.KVEvent{Type: messages.KVAllBlocksCleared, Medium: messages.MediumCPU}))
	require.NoError(t, err)
	require.Equal(t, Applied{}, res, "an engine's first register: nothing cleared, no catch-up")
	require.Equal(t, []string{"a", "b"}, x.Holders(".m", key(t, "aa", 0), t0))
	require.Equal(t, []string{"a"}, x.Holders(".n", key(t, "cc", 0), t0))

	res, err = x.applyPlain("a", "a1", "e", batch(messages.KVEvent{Type: messages.KVAllBlocksCleared, Medium: messages.MediumCPU, Namespace: "m"},
		stored("n", 0, "dd")))
	require.NoError(t, err)
	require.Equal(t, []string{"b"}, x.Holders(".m", key(t, "aa", 0), t0), "m's keys of a go, b's stay")
	require.Empty(t, x.Holders(".m", key(t, "bb", 0), t0))
	require.Equal(t, []string{"a"}, x.Holders(".n", key(t, "cc", 0), t0), "another namespace's keys of a stay")
	require.Equal(t, []string{"a"}, x.Holders(".n", key(t, "dd", 0), t0), "the clear freed room under the cap")
	require.Equal(t, 2, x.Nodes(t0)[0].Keys)
}

// "A node that is gone stops counting as a holder within lease_ms."
func TestSilentNodeStopsCountingWithinTheLease(t *testing.T) {
	x := New(lease, 0)
	_, _ = x.Heartbeat("a", "a1", t0)
	apply(t, x, "a", "a1", stored("m", 0, "aa"))
	k := key(t, "aa", 0)
	require.Equal(t, []string{"a"}, x.Holders(".m", k, t0.Add(lease-time.Millisecond)))
	require.Empty(t, x.Holders(".m", k, t0.Add(lease)))
	require.Equal(t, []string{"a"}, x.Expire(t0.Add(lease)))
	require.Empty(t, x.Nodes(t0.Add(lease)))
	require.Equal(t, uint64(1), x.Stats().Expired)
	// It comes back: new to the index, so it must be caught up.
	need, err := x.Heartbeat("a", "a1", t0.Add(2*lease))
	require.NoError(t, err)
	require.True(t, need)
	require.Empty(t, x.Holders(".m", k, t0.Add(2*lease)))
}

// A node whose kv_events came but never a hello or heartbeat (it died at
// once, or its first heartbeat was lost) is forgotten a lease after Expire
// first found it unheard, with its keys: they never counted, but they
// stayed indexed for the life of the process.
func TestANodeNeverHeardIsExpiredTooALeaseOn(t *testing.T) {
	x := New(lease, 0)
	apply(t, x, "a", "a1", stored("m", 0, "aa"))
	k := key(t, "aa", 0)
	require.Empty(t, x.Holders(".m", k, t0), "never heard: no holder")
	require.Empty(t, x.Expire(t0), "first found unheard")
	require.Empty(t, x.Expire(t0.Add(lease-time.Millisecond)))
	require.Equal(t, []string{"a"}, x.Expire(t0.Add(lease)))
	require.Empty(t, x.Nodes(t0.Add(lease)))
	require.Empty(t, x.held, "its keys dropped")
	// One heard before the lease ran out is not forgotten.
	apply(t, x, "b", "b1", stored("m", 0, "bb"))
	require.Empty(t, x.Expire(t0))
	_, err := x.Heartbeat("b", "b1", t0.Add(lease/2))
	require.NoError(t, err)
	require.Empty(t, x.Expire(t0.Add(lease)))
	require.Equal(t, []string{"b"}, x.Holders(".m", key(t, "bb", 0), t0.Add(lease)))
}

// A new boot drops everything the old process held, at once; a late
// message of the old boot changes nothing.
func TestNewBootDropsTheOldBootsKeysAndRetiresIt(t *testing.T) {
	x := New(lease, 0)
	need, _ := x.Heartbeat("a", "a1", t0)
	require.True(t, need, "a new node is caught up")
	need, _ = x.Heartbeat("a", "a1", t0.Add(time.Second))
	require.False(t, need, "a steady node is not")
	apply(t, x, "a", "a1", stored("m", 0, "aa"))
	need, err := x.Heartbeat("a", "a2", t0.Add(2*time.Second))
	require.NoError(t, err)
	require.True(t, need)
	require.Empty(t, x.Holders(".m", key(t, "aa", 0), t0.Add(2*time.Second)))

	_, err = x.applyPlain("a", "a1", "e", batch(stored("m", 0, "bb")))
	require.ErrorIs(t, err, ErrStaleBoot)
	_, err = x.Heartbeat("a", "a1", t0.Add(3*time.Second))
	require.ErrorIs(t, err, ErrStaleBoot)
	require.Empty(t, x.Holders(".m", key(t, "bb", 0), t0.Add(3*time.Second)))
	require.Equal(t, "a2", x.Nodes(t0)[0].Boot)
	require.Equal(t, uint64(2), x.Stats().Stale)
}

func TestAllBlocksClearedDropsTheNodesKeysOfItsNamespace(t *testing.T) {
	x := New(lease, 0)
	_, _ = x.Heartbeat("a", "a1", t0)
	apply(t, x, "a", "a1", stored("m", 0, "aa"), stored("n", 0, "bb"))
	res, err := x.applyPlain("a", "a1", "e", batch(messages.KVEvent{Type: messages.KVAllBlocksCleared, Medium: messages.MediumCPU, Namespace: "m"},
		stored("m", 0, "cc")))
	require.NoError(t, err)
	require.True(t, res.Cleared)
	require.Empty(t, x.Holders(".m", key(t, "aa", 0), t0))
	require.Equal(t, []string{"a"}, x.Holders(".n", key(t, "bb", 0), t0))
	require.Equal(t, []string{"a"}, x.Holders(".m", key(t, "cc", 0), t0), "events after the clear apply")
}

// Bad input: a clear error, counted, nothing else changed.
func TestMalformedBatchChangesNothing(t *testing.T) {
	x := New(lease, 0)
	_, _ = x.Heartbeat("a", "a1", t0)
	for _, b := range []messages.KVEventBatch{
		batch(stored("m", 0, "aa"), stored("m", 0, "zz")),
		batch(stored("m", 0, "aa"), stored("m", 0, "")),
		batch(stored("m", 0, "aa"), stored("m", -1, "bb")),
		batch(stored("m", 0, "aa"), messages.KVEvent{Type: "BlockEaten"}),
	} {
		_, err := x.applyPlain("a", "a1", "e", b)
		require.ErrorIs(t, err, ErrBadEvent)
	}
	require.Empty(t, x.Holders(".m", key(t, "aa", 0), t0))
	require.Equal(t, uint64(4), x.Stats().Rejected)
}

// A page read before a removal must not bring the removed key back.
func TestCatchUpPageLosesToARemovalSeenMeanwhile(t *testing.T) {
	x := New(lease, 0)
	_, _ = x.Heartbeat("a", "a1", t0)
	id, err := x.BeginCatchUp("a", "a1")
	require.NoError(t, err)
	apply(t, x, "a", "a1", removed("m", 0, "aa"))
	apply(t, x, "a", "a1", stored("m", 0, "cc"), removed("m", 0, "cc"), stored("m", 0, "cc"))
	page := []NSKey{{".m", key(t, "aa", 0)}, {".m", key(t, "bb", 0)}, {".m", key(t, "cc", 0)}}
	require.NoError(t, catchUpPage(x, "a", id, page))
	x.EndCatchUp("a", id)
	require.Empty(t, x.Holders(".m", key(t, "aa", 0), t0))
	require.Equal(t, []string{"a"}, x.Holders(".m", key(t, "bb", 0), t0))
	require.Equal(t, []string{"a"}, x.Holders(".m", key(t, "cc", 0), t0), "re-stored after the removal")
	require.ErrorIs(t, catchUpPage(x, "a", id, page), ErrNoSync, "an ended catch-up takes no page")

	// A superseded catch-up's pages are refused.
	old, _ := x.BeginCatchUp("a", "a1")
	cur, _ := x.BeginCatchUp("a", "a1")
	require.ErrorIs(t, catchUpPage(x, "a", old, page), ErrNoSync)
	require.NoError(t, catchUpPage(x, "a", cur, nil))
	// And one from before a reboot too.
	_, _ = x.Heartbeat("a", "a2", t0)
	require.ErrorIs(t, catchUpPage(x, "a", cur, page), ErrNoSync)
}

// A finished catch-up replaces the node's keys with what its pages listed
// and what kv_events stored meanwhile: a key evicted while its
// BlockRemoved was missed goes; a failed one changes nothing.
func TestFinishedCatchUpDropsTheKeysItDidNotList(t *testing.T) {
	x := New(lease, 0)
	_, _ = x.Heartbeat("a", "a1", t0)
	apply(t, x, "a", "a1", stored("m", 0, "aa", "bb", "dd"))
	id, err := x.BeginCatchUp("a", "a1")
	require.NoError(t, err)
	require.NoError(t, catchUpPage(x, "a", id, []NSKey{{".m", key(t, "bb", 0)}}))
	apply(t, x, "a", "a1", stored("m", 0, "cc")) // stored after the page was read
	apply(t, x, "a", "a1", stored("m", 0, "dd")) // a store event for a key held before
	x.EndCatchUp("a", id)                        // failed: nothing dropped
	require.Equal(t, []string{"a"}, x.Holders(".m", key(t, "aa", 0), t0))

	id, err = x.BeginCatchUp("a", "a1")
	require.NoError(t, err)
	require.NoError(t, catchUpPage(x, "a", id, []NSKey{{".m", key(t, "bb", 0)}}))
	apply(t, x, "a", "a1", stored("m", 0, "cc"), stored("m", 0, "dd"))
	x.FinishCatchUp("a", id)
	require.Empty(t, x.Holders(".m", key(t, "aa", 0), t0), "evicted while its BlockRemoved was missed")
	for _, h := range []string{"bb", "cc", "dd"} {
		require.Equal(t, []string{"a"}, x.Holders(".m", key(t, h, 0), t0), h)
	}
	require.Equal(t, 3, x.Nodes(t0)[0].Keys)
	x.FinishCatchUp("a", id) // once only
	require.Equal(t, 3, x.Nodes(t0)[0].Keys)
}

// A node's keys past the cap are left out, counted, and reported once per
// crossing; its earlier keys stay, its removals apply and free room, and
// another node is not affected. A catch-up that meets the cap first drops
// the keys its pages have not listed, which may be gone (evicted while
// their BlockRemoved was missed), then leaves out the keys past it: no key
// it did not list outlives it, cut at the cap or not. One that finishes
// without meeting the cap makes the node's keys whole again, as a clear or
// a new boot does, so the next crossing is reported again.
func TestTheCapLeavesOutANodesKeysPastItAndNoOtherNodes(t *testing.T) {
	x := New(lease, 2)
	_, _ = x.Heartbeat("a", "a1", t0)
	_, _ = x.Heartbeat("b", "b1", t0)
	held := func(node string, hs ...string) {
		t.Helper()
		var got []string
		for _, h := range []string{"aa", "bb", "cc", "dd", "ee"} {
			if slices.Contains(x.Holders(".m", key(t, h, 0), t0), node) {
				got = append(got, h)
			}
		}
		require.Equal(t, hs, got, "keys of %s", node)
	}
	steps := []struct {
		name string
		do   func() (Applied, error)
		want Applied
		a, b []string // the keys indexed after the step
	}{
		{"a stores three: the third is left out, the crossing reported",
			func() (Applied, error) { return x.applyPlain("a", "a1", "e", batch(stored("m", 0, "aa", "bb", "cc"))) },
			Applied{OverCap: 1, Capped: true}, []string{"aa", "bb"}, nil},
		{"b is not a's cap",
			func() (Applied, error) { return x.applyPlain("b", "b1", "e", batch(stored("m", 0, "cc", "dd"))) },
			Applied{}, []string{"aa", "bb"}, []string{"cc", "dd"}},
		{"a stores again: left out, counted, not reported twice",
			func() (Applied, error) { return x.applyPlain("a", "a1", "e", batch(stored("m", 0, "dd"))) },
			Applied{OverCap: 1}, []string{"aa", "bb"}, []string{"cc", "dd"}},
		{"a key a has is stored again: nothing left out",
			func() (Applied, error) { return x.applyPlain("a", "a1", "e", batch(stored("m", 0, "aa"))) },
			Applied{}, []string{"aa", "bb"}, []string{"cc", "dd"}},
		{"a removal applies and frees room for the next store",
			func() (Applied, error) {
				return x.applyPlain("a", "a1", "e", batch(removed("m", 0, "aa"), stored("m", 0, "dd", "ee")))
			},
			Applied{OverCap: 1}, []string{"bb", "dd"}, []string{"cc", "dd"}},
		{"a catch-up at the cap drops the keys no page listed yet, so its pages fill the room up to the cap; finished there, a's keys are what they listed",
			func() (Applied, error) {
				id, err := x.BeginCatchUp("a", "a1")
				require.NoError(t, err)
				res, err := x.CatchUpPage("a", id, []NSKey{{".m", key(t, "aa", 0)}, {".m", key(t, "bb", 0)}, {".m", key(t, "cc", 0)}})
				x.FinishCatchUp("a", id) // dd, not listed, went at aa; cc is past the cap
				return res, err
			},
			Applied{OverCap: 1}, []string{"aa", "bb"}, []string{"cc", "dd"}},
		{"still capped: a store past the cap after that catch-up is not reported again",
			func() (Applied, error) { return x.applyPlain("a", "a1", "e", batch(stored("m", 0, "dd", "ee"))) },
			Applied{OverCap: 2}, []string{"aa", "bb"}, []string{"cc", "dd"}},
		{"a key a evicted while its BlockRemoved was missed does not outlive a catch-up cut at the cap",
			func() (Applied, error) {
				id, err := x.BeginCatchUp("a", "a1")
				require.NoError(t, err)
				res, err := x.CatchUpPage("a", id, []NSKey{{".m", key(t, "bb", 0)}, {".m", key(t, "cc", 0)}, {".m", key(t, "dd", 0)}})
				x.FinishCatchUp("a", id) // aa, not listed, went at cc
				return res, err
			},
			Applied{OverCap: 1}, []string{"bb", "cc"}, []string{"cc", "dd"}},
		{"a catch-up that meets no cap sweeps what it did not list and makes a's keys whole again",
			func() (Applied, error) {
				id, err := x.BeginCatchUp("a", "a1")
				require.NoError(t, err)
				res, err := x.CatchUpPage("a", id, []NSKey{{".m", key(t, "bb", 0)}})
				x.FinishCatchUp("a", id) // dd goes
				return res, err
			},
			Applied{}, []string{"bb"}, []string{"cc", "dd"}},
		{"so the next crossing is reported",
			func() (Applied, error) { return x.applyPlain("a", "a1", "e", batch(stored("m", 0, "aa", "cc"))) },
			Applied{OverCap: 1, Capped: true}, []string{"aa", "bb"}, []string{"cc", "dd"}},
		{"a clear of m frees the room of a's keys in it; the crossing is not reported again until a catch-up (keys of another namespace may be left out)",
			func() (Applied, error) {
				return x.applyPlain("a", "a1", "e", batch(messages.KVEvent{Type: messages.KVAllBlocksCleared, Namespace: "m"}, stored("m", 0, "aa", "bb", "cc")))
			},
			Applied{Cleared: true, OverCap: 1}, []string{"aa", "bb"}, []string{"cc", "dd"}},
		{"a catch-up that meets no cap makes a's keys whole: the next crossing is reported",
			func() (Applied, error) {
				id, err := x.BeginCatchUp("a", "a1")
				require.NoError(t, err)
				res, err := x.CatchUpPage("a", id, []NSKey{{".m", key(t, "aa", 0)}})
				x.FinishCatchUp("a", id)
				if err != nil {
					return res, err
				}
				return x.applyPlain("a", "a1", "e", batch(stored("m", 0, "bb", "cc")))
			},
			Applied{OverCap: 1, Capped: true}, []string{"aa", "bb"}, []string{"cc", "dd"}},
	}
	var overCap uint64
	for _, s := range steps {
		got, err := s.do()
		require.NoError(t, err, s.name)
		require.Equal(t, s.want, got, s.name)
		held("a", s.a...)
		held("b", s.b...)
		overCap += uint64(s.want.OverCap)
		require.Equal(t, overCap, x.Stats().OverCap, s.name)
		for _, ni := range x.Nodes(t0) {
			require.LessOrEqual(t, ni.Keys, 2, s.name)
		}
	}
	require.True(t, x.Nodes(t0)[0].Capped)
	require.False(t, x.Nodes(t0)[1].Capped)

	// A new boot starts whole.
	_, err := x.Heartbeat("a", "a2", t0)
	require.NoError(t, err)
	require.False(t, x.Nodes(t0)[0].Capped)
	require.Zero(t, x.Nodes(t0)[0].Keys)
}

func TestKeyOfAppendsTheGroupBigEndian(t *testing.T) {
	require.Equal(t, messages.Key("\xab\x00\x00\x01\x02"), KeyOf([]byte{0xab}, 258))
}

func TestImportsOnlyTheStandardLibraryAndMessages(t *testing.T) {
	out, err := exec.Command("go", "list", "-deps", "-f", "{{if not .Standard}}{{.ImportPath}}{{end}}", ".").Output()
	require.NoError(t, err)
	for _, dep := range strings.Fields(string(out)) {
		require.Contains(t, []string{"github.com/kvactors/kvactors/cluster/holders", "github.com/kvactors/kvactors/messages"}, dep)
	}
}

// applyPlain is ApplyKVEvents with namespaces keyed by messages.NamespaceKey
// alone (no geometry): the index's rules do not depend on how a namespace
// is keyed, and the tests name namespaces plainly.
func (x *Index) applyPlain(nodeID, boot, engine string, b messages.KVEventBatch) (Applied, error) {
	return x.applyKVEvents(nodeID, boot, func(name string) string { return messages.NamespaceKey(engine, name) }, b)
}

// catchUpPage is CatchUpPage for a test that checks only its error.
func catchUpPage(x *Index, nodeID string, id uint64, keys []NSKey) error {
	_, err := x.CatchUpPage(nodeID, id, keys)
	return err
}

// What a catch-up remembers of the removals meanwhile is bounded by the
// cap per node (at least minRemovedBound), as the keys are ("Memory stays
// within the cap throughout", docs/CLUSTER.md): past it the catch-up is given up
// (Applied.Abandoned: the caller asks again) and takes no more pages; the
// removals still apply. Found by review: a node removing without end while
// its pages went on grew the set to 100,000 entries at a cap of 4.
func TestACatchUpsRemovalsAreBoundedByTheCap(t *testing.T) {
	const maxKeys = 4
	x := New(lease, maxKeys)
	_, err := x.Heartbeat("gpu-0", "a1", t0)
	require.NoError(t, err)
	apply(t, x, "gpu-0", "a1", stored("m", 0, "00"))
	id, err := x.BeginCatchUp("gpu-0", "a1")
	require.NoError(t, err)
	abandoned := false
	for i := range 100 {
		hs := make([]string, 1000)
		for j := range hs {
			hs[j] = fmt.Sprintf("%08x", i*1000+j+1)
		}
		res, err := x.ApplyKVEvents("gpu-0", "a1", "e1", 1, batch(removed("m", 0, hs...)))
		require.NoError(t, err)
		abandoned = abandoned || res.Abandoned
		if n := x.nodes["gpu-0"]; n.sync != nil {
			require.LessOrEqual(t, len(n.sync.removed), max(maxKeys, minRemovedBound))
		}
	}
	require.True(t, abandoned, "the caller is told to ask again")
	require.ErrorIs(t, catchUpPage(x, "gpu-0", id, nil), ErrNoSync, "a given-up catch-up takes no page")
	require.Equal(t, []string{"gpu-0"}, x.Holders(".m", key(t, "00", 0), t0))
	res, err := x.applyPlain("gpu-0", "a1", "e-gpu-0", batch(removed("m", 0, "00")))
	require.NoError(t, err)
	require.False(t, res.Abandoned)
	require.Empty(t, x.Holders(".m", key(t, "00", 0), t0), "a removal applies with no catch-up running")
}
