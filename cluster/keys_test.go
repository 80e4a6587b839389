package cluster

import (
	"context"
	"fmt"
	"math/rand/v2"
	"slices"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/cluster/holders"
	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/messages"
)

// countingKeys counts the asks of its source: a node's source may pay a
// pass over its whole set for each.
type countingKeys struct {
	KeySource
	asks atomic.Int64
}

func (c *countingKeys) KeysAfter(after holders.NSKey, max int) []holders.NSKey {
	c.asks.Add(1)
	return c.KeySource.KeysAfter(after, max)
}

// A catch-up over many pages returns every key once, in order, and asks
// the serving node's source once per page: fixed asks of 1024 keys made a
// full catch-up cost (keys/1024) passes over the set, quadratic in its
// size (100k keys: 3.5 s; at a million, pages past their timeout).
func TestACatchUpAsksItsSourceOncePerPageAndReturnsEveryKeyOnce(t *testing.T) {
	_, nc := testkit.NATS(t)
	var keys []holders.NSKey
	for i := range 100_000 {
		keys = append(keys, holders.NSKey{NS: fmt.Sprintf("ns%d", i%5), Key: holders.KeyOf([]byte(fmt.Sprintf("h%07d", i)), i%2)})
	}
	src := &countingKeys{KeySource: NewSortedKeys(keys)}
	sub, err := ServeKeys(nc, "kvactors", "gpu-0", "boot-a", src)
	require.NoError(t, err)
	t.Cleanup(func() { _ = sub.Unsubscribe() })

	var got []holders.NSKey
	pages := 0
	// Each page has its own 5 s; the whole catch-up is bounded only against
	// a hang: 100k keys took 6 s under -race beside another -race suite,
	// and past ctxT's 10 s once under two (the speed is not what is tested).
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	require.NoError(t, CatchUp(ctx, nc, "kvactors", "gpu-0", 5*time.Second, func(_ string, page []holders.NSKey) error {
		pages++
		got = append(got, page...)
		return nil
	}))
	require.Greater(t, pages, 2, "100000 keys fill pages under max_payload")
	require.Equal(t, int64(pages), src.asks.Load(), "asks of the source for %d pages", pages)
	want := slices.Clone(keys)
	slices.SortFunc(want, compareNSKey)
	require.Equal(t, len(want), len(got))
	require.True(t, slices.Equal(want, got), "every key once, in (namespace, key) order")
}

// Apply merges changes into a sorted set as a sort of the changed set
// would order it.
func TestSortedKeysApplyMatchesASortOfTheChangedSet(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	key := func() holders.NSKey {
		return holders.NSKey{NS: fmt.Sprintf("ns%d", r.IntN(3)), Key: messages.Key(fmt.Sprintf("k%03d", r.IntN(300)))}
	}
	set := map[holders.NSKey]bool{}
	var s SortedKeys
	for range 200 {
		changes := map[holders.NSKey]bool{}
		for range r.IntN(40) {
			k, in := key(), r.IntN(3) > 0
			changes[k] = in
			if in {
				set[k] = true
			} else {
				delete(set, k)
			}
		}
		s = s.Apply(changes)
		var want []holders.NSKey
		for k := range set {
			want = append(want, k)
		}
		require.True(t, slices.Equal(NewSortedKeys(want), s), "%d keys, want %d", len(s), len(want))
	}
}

// A peer whose pages do not move past the last key read (one that ignores
// "after", or sends a page out of order) ends the catch-up with an error
// at its second page, rather than being asked again for ever.
func TestACatchUpStopsOnAPageThatDoesNotAdvance(t *testing.T) {
	_, nc := testkit.NATS(t)
	for name, page := range map[string]string{
		"the same page again": `[{"namespace":"0000000000000001:m","key":"aa"}]`,
		"out of order":        `[{"namespace":"0000000000000001:m","key":"bb"},{"namespace":"0000000000000001:m","key":"aa"}]`,
	} {
		var asked atomic.Int32
		sub, err := nc.Subscribe("kvactors._node.peer.keys", func(m *nats.Msg) {
			asked.Add(1)
			_ = m.Respond([]byte(`{"node":"peer","boot":"b","keys":` + page + `,"done":false}`))
		})
		require.NoError(t, err)
		err = CatchUp(t.Context(), nc, "kvactors", "peer", 5*time.Second, func(string, []holders.NSKey) error { return nil })
		require.ErrorIs(t, err, ErrCatchUp, name)
		require.ErrorContains(t, err, "does not advance", name)
		require.LessOrEqual(t, asked.Load(), int32(2), name)
		require.NoError(t, sub.Unsubscribe())
	}
}
