package store

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/backend"
	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/sched"
)

// hookWaker runs fn on another goroutine when woken and waits for it: it
// stands for another goroutine that runs in the window between the two
// critical sections of a failed load's completion (CompleteStore(keys, nil),
// whose wake-ups run after its lock is released, then CompleteLoad(keys)).
type hookWaker struct{ fn func() }

func (h *hookWaker) Wake() {
	if h.fn == nil {
		return
	}
	fn := h.fn
	h.fn = nil
	done := make(chan struct{})
	go func() { fn(); close(done) }()
	<-done
}

// A load whose read back from disk fails ends in one step (Engine.complete,
// hostpool.By.EndLoad): its pending room is freed and its pins dropped
// under one lock. In two steps (CompleteStore(keys, nil), whose wake-ups
// run after its lock is released, then CompleteLoad(keys), which unpins by
// key), another load could store the key again and pin it in between, and
// the failed load's unpin would take that load's pin, leaving the chunk it
// copies evictable. The waker runs that other load in the window.
func TestAFailedReadBackKeepsAnotherLoadsPin(t *testing.T) {
	s, e, d, _ := onDiskOnly(t)

	// Load 1: room to read a back into (evicts b).
	_, err := e.PrepareLoad([]messages.Key{"a"})
	require.NoError(t, err)
	// Its read back will fail: a leaves the disk meanwhile (disk LRU, or a
	// bad record found by another read).
	d.Drop("e", "a")

	// Load 2, in the window: a is stored again from the device and pinned.
	pinnedByLoad2 := false
	e.WaitPending([]messages.Key{"a"}, &hookWaker{fn: func() { pinnedByLoad2 = storeAndPinAgain(t, e) }})

	err = e.Copy(backend.HostToDevice, []sched.JobChunk{chunk("a", 5)}, nil) // load 1: read back fails
	require.Error(t, err)
	require.True(t, pinnedByLoad2)

	// Load 2 has not completed: a must still be pinned.
	assert.Equal(t, 1, s.Stats().Pinned, "load 2's pin on a was taken by load 1's failed completion")
	// And so it must not be evictable.
	prep, err := e.PrepareStore([]messages.Key{"x", "y"}, []int64{testBlockBytes, testBlockBytes})
	if err == nil {
		assert.NotContains(t, prep.Evicted, messages.Key("a"), "a chunk pinned by a running load was evicted")
	}
}

// The same for a load aborted while queued (cancelled, or refused by the
// fence or engine silence: transfer's abort): another load's pin on a key
// stored again between freeing the aborted load's room and its unpin
// stays.
func TestAnAbortedLoadKeepsAnotherLoadsPin(t *testing.T) {
	s, e, _, _ := onDiskOnly(t)
	_, err := e.PrepareLoad([]messages.Key{"a"}) // load 1, queued
	require.NoError(t, err)
	// load 2, between load 1's two completion steps
	e.WaitPending([]messages.Key{"a"}, &hookWaker{fn: func() { storeAndPinAgain(t, e) }})
	e.Abort(backend.HostToDevice, []sched.JobChunk{chunk("a", 5)}) // load 1 cancelled while queued
	assert.Equal(t, 1, s.Stats().Pinned, "load 2's pin on a was taken by load 1's abort")
}

// storeAndPinAgain stores a again from device block 1 and pins it for a
// load (load 2), reporting whether all of it went through.
func storeAndPinAgain(t *testing.T, e *Engine) bool {
	prep, err := e.PrepareStore([]messages.Key{"a"}, []int64{testBlockBytes})
	if err != nil || len(prep.Keys) != 1 {
		t.Errorf("store a again: %v %v", prep.Keys, err)
		return false
	}
	if err := e.Copy(backend.DeviceToHost, []sched.JobChunk{chunk("a", 1)}, nil); err != nil {
		t.Errorf("copy a: %v", err)
		return false
	}
	if _, err := e.PrepareLoad([]messages.Key{"a"}); err != nil {
		t.Errorf("load 2 prepare: %v", err)
		return false
	}
	return true
}
