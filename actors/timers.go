package actors

import (
	"container/heap"
	"sync"
	"time"

	"github.com/asynkron/protoactor-go/actor"
	"github.com/prometheus/client_golang/prometheus"
)

// Timers sends delayed messages, all from one goroutine, in the order they
// fall due. A request actor runs on whoever posts to it (InlineMailbox), so
// a message sent by time.AfterFunc (protoactor's scheduler.TimerScheduler
// sends that way too) would run the whole store decision on a goroutine of
// its own: in a burst, with thousands of requests waiting for
// pool room, those goroutines queued on the same locks (an engine's release
// lock, the pool's) and each held a stack. A 100k-request burst measured
// 300 such goroutines and +70 MiB of anon memory in a typical run, 66,000
// and +550 MiB in the worst. Here a pending message costs one heap entry,
// and a delivery that blocks delays the ones after it instead of starting
// another goroutine.
//
// Stop drops what is still pending; a Send after Stop is dropped too (its
// receiver is being stopped with the owner).
type Timers struct {
	root  *actor.RootContext
	gauge prometheus.Gauge // pending messages, across every engine's timers (nil: none)

	mu      sync.Mutex
	pending timerHeap
	seq     uint64 // ties fall due in the order they were sent
	stopped bool

	wake chan struct{} // cap 1: a new earliest entry, or Stop
	done chan struct{}
	// waiting, when set (tests), is told each wait before the goroutine
	// sleeps on it.
	waiting func(time.Duration)
}

// NewTimers starts the delivering goroutine; Stop ends it. pending, when
// set, counts the messages waiting (a node's engines share one gauge).
func NewTimers(root *actor.RootContext, pending prometheus.Gauge) *Timers {
	t := &Timers{root: root, gauge: pending, wake: make(chan struct{}, 1), done: make(chan struct{})}
	go t.run()
	return t
}

// Send sends msg to to after d.
func (t *Timers) Send(d time.Duration, to *actor.PID, msg any) {
	t.sendAt(time.Now().Add(d), to, msg)
}

func (t *Timers) sendAt(due time.Time, to *actor.PID, msg any) {
	t.mu.Lock()
	if t.stopped {
		t.mu.Unlock()
		return
	}
	t.seq++
	e := timerEntry{due: due, seq: t.seq, to: to, msg: msg}
	heap.Push(&t.pending, e)
	first := t.pending[0].seq == e.seq
	t.count(1)
	t.mu.Unlock()
	if first {
		t.poke()
	}
}

// Pending is how many messages wait to fall due.
func (t *Timers) Pending() int {
	t.mu.Lock()
	defer t.mu.Unlock()
	return len(t.pending)
}

// Stop drops the pending messages; the goroutine ends after the delivery
// in progress, if any. It does not wait for that delivery: a receiver that
// stops its owner from inside it must not deadlock.
func (t *Timers) Stop() {
	t.mu.Lock()
	t.stopped = true
	t.count(-len(t.pending))
	t.pending = nil
	t.mu.Unlock()
	t.poke()
}

// count moves the gauge by n; under t.mu, so Stop's drop and a delivery's
// pop are each counted once.
func (t *Timers) count(n int) {
	if t.gauge != nil && n != 0 {
		t.gauge.Add(float64(n))
	}
}

func (t *Timers) poke() {
	select {
	case t.wake <- struct{}{}:
	default:
	}
}

func (t *Timers) run() {
	defer close(t.done)
	clock := time.NewTimer(time.Hour)
	defer clock.Stop()
	for {
		e, wait, ok := t.next()
		if !ok {
			return
		}
		if wait > 0 {
			if t.waiting != nil {
				t.waiting(wait)
			}
			clock.Reset(wait)
			select {
			case <-clock.C:
			case <-t.wake:
				clock.Stop()
			}
			continue // look again: an earlier entry may have come, or Stop
		}
		t.root.Send(e.to, e.msg)
	}
}

// next pops the entry that is due, or says how long until the earliest
// one (an hour when none is pending); ok is false once stopped.
func (t *Timers) next() (e timerEntry, wait time.Duration, ok bool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.stopped {
		return e, 0, false
	}
	if len(t.pending) == 0 {
		if cap(t.pending) > 1024 {
			t.pending = nil // after a burst: let the collector have the backing array
		}
		return e, time.Hour, true
	}
	if wait = time.Until(t.pending[0].due); wait > 0 {
		return e, wait, true
	}
	t.count(-1)
	return heap.Pop(&t.pending).(timerEntry), 0, true
}

type timerEntry struct {
	due time.Time
	seq uint64
	to  *actor.PID
	msg any
}

type timerHeap []timerEntry

func (h timerHeap) Len() int { return len(h) }
func (h timerHeap) Less(i, j int) bool {
	if !h[i].due.Equal(h[j].due) {
		return h[i].due.Before(h[j].due)
	}
	return h[i].seq < h[j].seq
}
func (h timerHeap) Swap(i, j int) { h[i], h[j] = h[j], h[i] }
func (h *timerHeap) Push(x any)   { *h = append(*h, x.(timerEntry)) }
func (h *timerHeap) Pop() any {
	old := *h
	e := old[len(old)-1]
	old[len(old)-1] = timerEntry{} // let the message go
	*h = old[:len(old)-1]
	return e
}
