package actors

import (
	"sync"

	"github.com/asynkron/protoactor-go/actor"
)

// LoopDispatcher runs the mailbox of the one actor it is given to on a
// goroutine that lives as long as that actor. protoactor's default
// dispatcher starts a goroutine for every mailbox run instead: an actor that
// wakes thousands of times a second (the transfer actor, once per batch of
// finished copies; an engine actor, once per released request) then starts
// each run on a fresh small stack and grows it by copying as the run
// descends into the request actors it runs inline. That growth was 4–5% of
// the node's CPU at 25–50% load (docs/BENCHMARKS.md, eighth session); a
// long-lived goroutine keeps its grown stack.
//
// A mailbox schedules at most one run at a time, so one pending slot would
// do; the channel holds a few, and a run that finds it full (never expected)
// or arrives after Close gets a goroutine of its own, as with protoactor's
// dispatcher: no run is ever dropped. The goroutine starts with the first
// run (Props built and never spawned cost none). The owning actor calls
// Close when it stops; the loop then finishes what it holds and exits.
type LoopDispatcher struct {
	mu     sync.RWMutex // orders Schedule's send against Close's close
	closed bool
	start  sync.Once // the loop goroutine, or (closed unused) Exited
	runs   chan func()
	exited chan struct{}
}

// loopThroughput is protoactor's default dispatcher's: how many messages a
// run handles before it yields the processor.
const loopThroughput = 300

// NewLoopDispatcher makes a dispatcher whose loop starts with its first run.
func NewLoopDispatcher() *LoopDispatcher {
	return &LoopDispatcher{runs: make(chan func(), 4), exited: make(chan struct{})}
}

func (d *LoopDispatcher) loop() {
	defer close(d.exited)
	for run := range d.runs {
		run()
	}
}

// Exited is closed once the loop goroutine has returned after Close (at
// Close, if it never started).
func (d *LoopDispatcher) Exited() <-chan struct{} { return d.exited }

// Schedule runs fn on the loop, or on a goroutine of its own when the loop
// is closed or (unexpectedly) backed up.
func (d *LoopDispatcher) Schedule(fn func()) {
	d.mu.RLock()
	if !d.closed {
		d.start.Do(func() { go d.loop() })
		select {
		case d.runs <- fn:
			d.mu.RUnlock()
			return
		default:
		}
	}
	d.mu.RUnlock()
	go fn()
}

// Throughput is how many messages a mailbox run handles before yielding.
func (d *LoopDispatcher) Throughput() int { return loopThroughput }

// Close lets the loop exit once it has run what it holds. It may be called
// from a run on the loop itself (an actor's Stopped) and more than once.
func (d *LoopDispatcher) Close() {
	d.mu.Lock()
	defer d.mu.Unlock()
	if !d.closed {
		d.closed = true
		close(d.runs)
		d.start.Do(func() { close(d.exited) }) // never started: nothing to wait for
	}
}

var _ actor.Dispatcher = (*LoopDispatcher)(nil)
