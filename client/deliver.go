package client

import (
	"sync"

	"github.com/kvactors/kvactors/messages"
)

// dispatcher runs the engine's callbacks on one goroutine of its own, in
// order, from an unbounded queue: a NATS handler only appends, so a slow
// callback never makes the NATS client drop messages.
type dispatcher struct {
	onReleased func(Release)
	onStored   func(messages.Stored)
	onRefused  func(error)

	mu     sync.Mutex
	queue  []any // Release, messages.Stored or refusal
	wakeup chan struct{}
	done   chan struct{}
	exited chan struct{}
}

// refusal is a refused re-register, for Config.OnRegisterRefused.
type refusal struct{ err error }

func newDispatcher(onReleased func(Release), onStored func(messages.Stored), onRefused func(error)) *dispatcher {
	d := &dispatcher{onReleased: onReleased, onStored: onStored, onRefused: onRefused, wakeup: make(chan struct{}, 1),
		done: make(chan struct{}), exited: make(chan struct{})}
	go d.run()
	return d
}

func (d *dispatcher) push(v any) {
	d.mu.Lock()
	d.queue = append(d.queue, v)
	d.mu.Unlock()
	select {
	case d.wakeup <- struct{}{}:
	default:
	}
}

func (d *dispatcher) run() {
	defer close(d.exited)
	for {
		select {
		case <-d.done:
			return
		case <-d.wakeup:
		}
		for {
			d.mu.Lock()
			q := d.queue
			d.queue = nil
			d.mu.Unlock()
			if len(q) == 0 {
				break
			}
			for _, v := range q {
				select {
				case <-d.done:
					return
				default:
				}
				switch v := v.(type) {
				case Release:
					if d.onReleased != nil {
						d.onReleased(v)
					}
				case messages.Stored:
					if d.onStored != nil {
						d.onStored(v)
					}
				case refusal:
					if d.onRefused != nil {
						d.onRefused(v.err)
					}
				}
			}
		}
	}
}

// close stops the dispatcher and waits for the callback running, if any;
// what is still queued is not delivered.
func (d *dispatcher) close() {
	close(d.done)
	<-d.exited
}
