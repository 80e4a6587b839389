package sched

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/hostpool"
	"github.com/kvactors/kvactors/messages"
)

// PROTOCOL.md "Isolation": keys live in a namespace, so the same prefix in
// two namespaces is two sets of keys (both stored, neither deduplicated
// against the other), while a second request in the same namespace is
// deduplicated.
func TestNamespacesNeverShareKeys(t *testing.T) {
	pool := hostpool.New(64*testBlockBytes, testBlockBytes) // room for 64 one-block chunks
	store := func(ns NamespaceID, id string) *StoreJob {
		lay := layout(t, 4, 1, full(4))
		lay.Namespace = ns
		add := added(8)
		add.Request = id
		r := NewRequest(lay, add)
		for _, ev := range []*messages.Event{hashes(0, 2), blocks(0, 0, 1, 2), tokens(8, 8)} {
			ev.Request = id
			require.NoError(t, r.Step(ev))
		}
		e := r.Advance(pool)
		if e.Job != nil {
			pool.CompleteStore(e.Job.Keys(), sumsIf(e.Job.Keys(), true))
			for _, c := range e.Job.Chunks {
				gotNS, h, g := SplitKey(c.Key)
				require.Equal(t, ns, gotNS, "every key of the job is in the layout's namespace")
				require.Equal(t, hash(int(c.Index)), h)
				require.Equal(t, c.Group, g)
			}
		}
		return e.Job
	}
	a := store(1, "a")
	require.NotNil(t, a)
	b := store(2, "b")
	require.NotNil(t, b, "namespace 2 does not see namespace 1's chunks")
	require.NotEqual(t, a.Keys(), b.Keys())
	require.Nil(t, store(1, "c"), "a second request in namespace 1 is deduplicated")
}
