package hostpool

import (
	"errors"
	"fmt"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/messages"
)

type journaled struct {
	stored bool
	keys   []messages.Key
	engine string
}

// recorder is a Journal that keeps every change, in order.
func recorder(into *[]journaled) Journal {
	return func(stored bool, keys []messages.Key, engine string) {
		*into = append(*into, journaled{stored, append([]messages.Key(nil), keys...), engine})
	}
}

// The journal hears of a key when it becomes loadable (a completed store,
// a fill from disk) and when it stops being loadable (an eviction to make
// room, for a store or a load reading back from disk; a drop), naming the
// engine whose operation it was; a failed or
// aborted store, a load and a lookup change nothing loadable and say
// nothing.
func TestJournalNamesEveryLoadableChange(t *testing.T) {
	var got []journaled
	s := NewShared(3*16, 16)
	s.SetJournal(recorder(&got))
	ea, eb := s.By("ea"), s.By("eb")

	prep, err := ea.PrepareStore(k("a", "b"), nil)
	require.NoError(t, err)
	ea.CompleteStoreAt(prep.Keys, prep.Slots, okSums(prep.Keys, true))
	prep, err = eb.PrepareStore(k("c", "d"), nil) // evicts a (LRU): room for two
	require.NoError(t, err)
	eb.CompleteStore(k("c"), okSums(k("c"), true))
	eb.CompleteStore(k("d"), nil) // a failed copy: d never was loadable
	require.NoError(t, s.PrepareLoad(k("b")))
	s.CompleteLoad(k("b"))
	require.False(t, eb.Drop("c", okSums(k("c"), true)[0]+1), "another copy of c: nothing dropped, nothing said")
	require.True(t, eb.Drop("c", okSums(k("c"), true)[0]))
	require.False(t, eb.Drop("zz", 0), "absent: nothing dropped, nothing said")
	// A load reading x and y back from disk makes room (evicting e, not b,
	// which it pins) and then makes them ready, both in its engine's name.
	prep, err = ea.PrepareStore(k("e"), nil)
	require.NoError(t, err)
	ea.CompleteStore(prep.Keys, okSums(prep.Keys, true))
	ec := s.By("ec")
	prep, err = ec.PrepareLoadFrom(k("b", "x", "y"), func(messages.Key) (int64, bool) { return 16, true })
	require.NoError(t, err)
	require.Equal(t, k("x", "y"), prep.Keys)
	ec.CompleteStorePinned(prep.Keys, okSums(prep.Keys, true))
	s.CompleteLoad(k("b", "x", "y"))

	require.Equal(t, []journaled{
		{true, k("a", "b"), "ea"},
		{false, k("a"), "eb"},
		{true, k("c"), "eb"},
		{false, k("c"), "eb"},
		{true, k("e"), "ea"},
		{false, k("e"), "ec"},
		{true, k("x", "y"), "ec"},
	}, got)
}

// Under concurrent stores, evictions and drops from several goroutines,
// replaying the journal in order ends exactly where the pool is: the
// journal is told under the pool's lock, so its order is the pool's.
func TestJournalReplaysToThePool(t *testing.T) {
	s := NewShared(8*16, 16)
	var mu sync.Mutex // the journal runs under s.mu; mu only guards model against the final read
	model := map[messages.Key]bool{}
	var bad error // the journal runs on the workers' goroutines: checked at the end
	s.SetJournal(func(stored bool, keys []messages.Key, _ string) {
		mu.Lock()
		defer mu.Unlock()
		for _, key := range keys {
			if model[key] == stored && bad == nil {
				bad = fmt.Errorf("%s: told stored=%v twice in a row", key, stored)
			}
			model[key] = stored
		}
	})
	const workers, rounds = 6, 400
	var wg sync.WaitGroup
	errs := make(chan error, workers)
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			by := s.By(fmt.Sprintf("e%d", w))
			for i := range rounds {
				keys := k(fmt.Sprintf("k%d", (i*7+w)%20), fmt.Sprintf("k%d", (i*3+w*5)%20))
				prep, err := by.PrepareStore(keys, nil)
				if err != nil && !errors.Is(err, ErrNoRoom) {
					errs <- err
					return
				}
				by.CompleteStoreAt(prep.Keys, prep.Slots, okSums(prep.Keys, i%5 != 0))
				if loc, err := s.Locate(keys[:1]); i%9 == 0 && err == nil {
					by.Drop(keys[0], loc.Sums[0])
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		require.NoError(t, err)
	}
	mu.Lock()
	defer mu.Unlock()
	require.NoError(t, bad)
	for i := range 20 {
		key := messages.Key(fmt.Sprintf("k%d", i))
		st, _ := s.Lookup(key)
		require.Equal(t, st == Ready, model[key], "%s: the journal's view is the pool's", key)
	}
}

// Reannounce journals every ready key as stored, least recently used
// first, in no engine's name; a pending key is not loadable and is left
// out.
func TestReannounceJournalsEveryReadyKey(t *testing.T) {
	var got []journaled
	s := NewShared(4*16, 16)
	s.SetJournal(recorder(&got))
	e := s.By("e")
	prep, err := e.PrepareStore(k("a", "b", "c"), nil)
	require.NoError(t, err)
	e.CompleteStore(k("b", "a"), okSums(k("b", "a"), true))
	require.NoError(t, s.PrepareLoad(k("b"))) // pinned: still loadable
	got = nil
	s.Reannounce()
	require.Equal(t, []journaled{{true, k("a", "b"), ""}}, got)
	e.CompleteStore(prep.Keys, nil)
	s.CompleteLoad(k("b"))
}
