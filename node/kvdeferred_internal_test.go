package node

import (
	"fmt"
	"maps"
	"slices"
	"testing"
	"testing/quick"

	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/sched"
)

// deferKey is key h (one byte) of group g in namespace ns.
func deferKey(ns sched.NamespaceID, h byte, g int) messages.Key {
	return sched.Key(ns, messages.Hash([]byte{h}), g)
}

// A router that was told a namespace's changes up to the moment its last
// member left, then the deferred changes when an engine joins it, ends
// believing exactly what the pool holds (PROTOCOL.md "kv_events"); past the
// bound it believes no more than that. Checked against the naive model (a
// router told every change as it happened) over random changes, joins and
// bounds: a router keyed by (namespace, key, medium), as the announcements
// address it.
func TestKVDeferredReplaysToThePoolsState(t *testing.T) {
	type id struct {
		ns  sched.NamespaceID
		key messages.Key
		med string
	}
	media := []string{messages.MediumCPU, messages.MediumDisk}
	types := []string{messages.KVBlockStored, messages.KVBlockRemoved}
	check := func(ops []uint16, initial uint64, bound uint8) error {
		most := int(bound % 40) // 96 distinct changes: the bound is often passed
		x := newKVDeferred(most)
		truth, router := map[id]bool{}, map[id]bool{} // what the pool holds, what the router believes
		// Told before the namespaces lost their members: the router agrees.
		for b := range 64 {
			if initial&(1<<b) != 0 {
				i := id{sched.NamespaceID(1 + b%3), deferKey(sched.NamespaceID(1+b%3), byte(b/3%8), b/24%2), media[b/48%2]}
				truth[i], router[i] = true, true
			}
		}
		everCleared := map[sched.NamespaceID]bool{}
		// order is each namespace's ids in the order of their latest change
		// since its last join.
		order := map[sched.NamespaceID][]id{}
		join := func(ns sched.NamespaceID) error {
			cleared, changes := x.take(ns)
			want := order[ns]
			delete(order, ns)
			if cleared {
				everCleared[ns] = true
				maps.DeleteFunc(router, func(i id, _ bool) bool { return i.ns == ns })
			} else {
				var got []id
				for _, c := range changes {
					got = append(got, id{ns, c.key, c.medium})
				}
				if !slices.Equal(got, want) {
					return fmt.Errorf("namespace %d: changes %v, want each key's latest in the order of the latest: %v", ns, got, want)
				}
			}
			for _, c := range changes {
				i := id{ns, c.key, c.medium}
				if c.typ == messages.KVBlockStored {
					router[i] = true
				} else {
					delete(router, i)
				}
			}
			for i := range router {
				if i.ns == ns && !truth[i] {
					return fmt.Errorf("namespace %d: the router believes %v held, which is gone", ns, i)
				}
			}
			if !everCleared[ns] {
				for i := range truth {
					if i.ns == ns && !router[i] {
						return fmt.Errorf("namespace %d, never past the bound: the router misses %v", ns, i)
					}
				}
			}
			return nil
		}
		var dropped int
		for _, op := range ops {
			ns := sched.NamespaceID(1 + op%3)
			if op%17 == 0 {
				if err := join(ns); err != nil {
					return err
				}
				continue
			}
			i := id{ns, deferKey(ns, byte(op/3%8), int(op/24%2)), media[op/48%2]}
			typ := types[op/96%2]
			truth[i] = typ == messages.KVBlockStored
			if !truth[i] {
				delete(truth, i)
			}
			order[ns] = append(slices.DeleteFunc(order[ns], func(j id) bool { return j == i }), i)
			wasCleared := x.byNS[ns] != nil && x.byNS[ns].cleared
			kept, d := x.add(ns, typ, i.med, []messages.Key{i.key})
			wantKept := 1
			if wasCleared && typ == messages.KVBlockRemoved {
				wantKept = 0 // a removal after the clear tells a router nothing
			}
			if kept != wantKept {
				return fmt.Errorf("a %s of %v counted %d kept, want %d", typ, i, kept, wantKept)
			}
			dropped += d
			if x.held > most {
				return fmt.Errorf("%d changes kept, bound %d", x.held, most)
			}
		}
		for ns := range sched.NamespaceID(3) {
			if err := join(ns + 1); err != nil {
				return err
			}
		}
		if x.held != 0 || len(x.byNS) != 0 {
			return fmt.Errorf("all taken: %d changes, %d namespaces left", x.held, len(x.byNS))
		}
		if (dropped > 0) != (len(everCleared) > 0) {
			return fmt.Errorf("%d dropped, namespaces cleared %v", dropped, everCleared)
		}
		return nil
	}
	require.NoError(t, quick.Check(func(ops []uint16, initial uint64, bound uint8) bool {
		if err := check(ops, initial, bound); err != nil {
			t.Log(err)
			return false
		}
		return true
	}, &quick.Config{MaxCount: 2000}))
}

// Deferred changes keep each key's latest in each medium, in the order of
// those latest changes; past the bound the namespace keeping the most is
// cleared (its changes dropped and counted) and keeps only what is stored
// after.
func TestKVDeferredKeepsTheLatestAndClearsPastTheBound(t *testing.T) {
	a, b, c := deferKey(1, 'a', 0), deferKey(1, 'b', 0), deferKey(1, 'c', 1)
	x := newKVDeferred(4)
	require.False(t, x.has(1))
	require.Equal(t, [2]int{2, 0}, pair(x.add(1, messages.KVBlockRemoved, messages.MediumCPU, []messages.Key{a, b})))
	require.Equal(t, [2]int{1, 0}, pair(x.add(1, messages.KVBlockStored, messages.MediumDisk, []messages.Key{a})))
	require.Equal(t, [2]int{1, 0}, pair(x.add(1, messages.KVBlockStored, messages.MediumCPU, []messages.Key{a})))
	require.True(t, x.has(1))
	require.False(t, x.has(2))
	cleared, changes := x.take(1)
	require.False(t, cleared)
	require.Equal(t, []kvChange{
		{b, messages.KVBlockRemoved, messages.MediumCPU},
		{a, messages.KVBlockStored, messages.MediumDisk},
		{a, messages.KVBlockStored, messages.MediumCPU},
	}, changes)
	require.False(t, x.has(1))
	require.Zero(t, x.held)

	// Namespace 2 keeps one, namespace 1 three; the fifth change passes the
	// bound and namespace 1, keeping the most, is cleared.
	d := deferKey(2, 'd', 0)
	require.Equal(t, [2]int{1, 0}, pair(x.add(2, messages.KVBlockRemoved, messages.MediumCPU, []messages.Key{d})))
	require.Equal(t, [2]int{3, 0}, pair(x.add(1, messages.KVBlockRemoved, messages.MediumCPU, []messages.Key{a, b, c})))
	require.Equal(t, [2]int{1, 4}, pair(x.add(1, messages.KVBlockStored, messages.MediumDisk, []messages.Key{b})))
	require.Zero(t, cap(x.byNS[1].list), "the cleared namespace's list is let go, not kept at its peak")
	require.Equal(t, 1, x.held, "namespace 2's change kept")
	require.Equal(t, [2]int{1, 0}, pair(x.add(1, messages.KVBlockStored, messages.MediumCPU, []messages.Key{c})))
	require.Equal(t, [2]int{0, 0}, pair(x.add(1, messages.KVBlockRemoved, messages.MediumCPU, []messages.Key{a})),
		"a removal after the clear is not kept")
	cleared, changes = x.take(1)
	require.True(t, cleared)
	require.Equal(t, []kvChange{{c, messages.KVBlockStored, messages.MediumCPU}}, changes)
	cleared, changes = x.take(2)
	require.False(t, cleared)
	require.Equal(t, []kvChange{{d, messages.KVBlockRemoved, messages.MediumCPU}}, changes)

	// A key changed over and over keeps one change, and the list compacts.
	for i := range 1000 {
		typ := messages.KVBlockStored
		if i%2 == 1 {
			typ = messages.KVBlockRemoved
		}
		require.Equal(t, [2]int{1, 0}, pair(x.add(3, typ, messages.MediumCPU, []messages.Key{a})))
	}
	require.Less(t, len(x.byNS[3].list), 20)
	_, changes = x.take(3)
	require.Equal(t, []kvChange{{a, messages.KVBlockRemoved, messages.MediumCPU}}, changes)
}

// pair is add's two results as one value.
func pair(kept, dropped int) [2]int { return [2]int{kept, dropped} }
