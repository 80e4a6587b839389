package store

import (
	"errors"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/backend"
	"github.com/kvactors/kvactors/hostpool"
	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/sched"
)

type countWake struct{ n atomic.Int32 }

func (c *countWake) Wake() { c.n.Add(1) }

// WaitRoom wakes waiters first in, first out, as many per change as the
// keys it freed or made evictable. A load's completion that frees nothing
// (its keys were all in host memory) and leaves its keys pinned (another
// load holds them) wakes none: woken, they would find no room and queue
// again at the back, and each load completion in a full pool would send
// the head of the queue to its tail, unserved.
func TestALoadCompletionThatFreesNothingWakesNoRoomWaiter(t *testing.T) {
	s, e, _, _ := fixture(t, 1, 2*testBlockBytes, testBlockBytes) // two chunks
	storeChunks(t, e, chunk("a", 1), chunk("b", 2))
	keys := []messages.Key{"a", "b"}
	_, err := e.PrepareLoad(keys) // load 1
	require.NoError(t, err)
	_, err = e.PrepareLoad(keys) // load 2: both pinned twice
	require.NoError(t, err)

	prep, err := e.PrepareStore([]messages.Key{"c"}, []int64{testBlockBytes})
	require.True(t, errors.Is(err, hostpool.ErrNoRoom), "%v", err)
	w1, w2 := &countWake{}, &countWake{}
	e.WaitRoom(w1, prep.RoomGen)
	e.WaitRoom(w2, prep.RoomGen)
	require.Equal(t, 2, s.pool.RoomWaiting())

	// Load 1 ends: nothing freed, a and b still pinned by load 2.
	require.NoError(t, e.Copy(backend.HostToDevice, []sched.JobChunk{chunk("a", 5), chunk("b", 6)}, nil))
	st := s.Stats()
	require.Equal(t, 2, st.Pinned)
	_, err = e.PrepareStore([]messages.Key{"c"}, []int64{testBlockBytes})
	require.True(t, errors.Is(err, hostpool.ErrNoRoom), "still no room")

	assert.Zero(t, w1.n.Load()+w2.n.Load(), "room waiters woken (and dequeued) by a change that freed nothing")
	assert.Equal(t, 2, s.pool.RoomWaiting(), "waiters lost their place in the room queue")
}
