package actors

import (
	"runtime"
	"sync"

	"github.com/asynkron/protoactor-go/actor"
)

// InlineMailbox is the mailbox of actors that run on the goroutine that
// posts to them while they are idle (request actors: an engine step and a
// completion batch are each one unit of work, with no goroutine hand-off
// per request). It replaces protoactor's default mailbox plus a
// synchronized dispatcher for an actor that lives long and mostly sleeps:
// that pair costs ~370 heap bytes per idle actor (a 10-slot ring, a
// lock-free queue's stub node, a closure per schedule); this one keeps two
// slices that stay nil until used and are reused once drained.
//
// Semantics are the default mailbox's: one runner at a time (a message
// posted while the actor runs waits for that runner), system messages
// before user messages, a suspended mailbox (after a failure is escalated)
// runs only system messages, and a panic is escalated to the supervisor.
// Post from inside a run is queued, never recursive.
func InlineMailbox() actor.Mailbox { return &inlineMailbox{} }

// InlineMailboxFor is InlineMailbox for the messages inline accepts (user
// messages only); any other post to an idle actor runs it on its
// dispatcher, as protoactor's default mailbox does. An engine actor takes
// its batches on the ingest worker that decoded them, while its timers,
// lifecycle messages and anything posted by code that may hold a lock the
// actor needs keep their own goroutine.
func InlineMailboxFor(inline func(msg any) bool) actor.MailboxProducer {
	return func() actor.Mailbox {
		m := &inlineMailbox{some: &someInline{inline: inline}}
		m.some.run = m.run // one closure per mailbox, not one per schedule
		return m
	}
}

// inlineThroughput is how many messages one run handles before yielding
// the processor, as protoactor's dispatchers do.
const inlineThroughput = 300

type inlineMailbox struct {
	mu        sync.Mutex
	user      []any
	userHead  int
	system    []any
	running   bool
	suspended bool
	invoker   actor.MessageInvoker
	some      *someInline // nil: every post runs inline
}

// someInline is InlineMailboxFor's: inline picks the posts that run on the
// poster; the rest run on dispatcher (run is the mailbox's run, made once).
type someInline struct {
	inline     func(msg any) bool
	dispatcher actor.Dispatcher
	run        func()
}

func (m *inlineMailbox) PostUserMessage(msg any) {
	m.mu.Lock()
	m.user = append(m.user, msg)
	m.scheduleLocked(m.some == nil || m.some.inline(msg))
}

func (m *inlineMailbox) PostSystemMessage(msg any) {
	m.mu.Lock()
	m.system = append(m.system, msg)
	m.scheduleLocked(m.some == nil)
}

// scheduleLocked starts a runner unless one already has the mailbox: here
// (here) or on the dispatcher. It releases m.mu either way.
func (m *inlineMailbox) scheduleLocked(here bool) {
	if m.running {
		m.mu.Unlock()
		return
	}
	m.running = true
	m.mu.Unlock()
	if here {
		m.run()
	} else {
		m.some.dispatcher.Schedule(m.some.run)
	}
}

// RegisterHandlers keeps the invoker, and the dispatcher for the posts
// that do not run inline.
func (m *inlineMailbox) RegisterHandlers(invoker actor.MessageInvoker, dispatcher actor.Dispatcher) {
	m.invoker = invoker
	if m.some != nil {
		m.some.dispatcher = dispatcher
	}
}

func (m *inlineMailbox) Start() {}

func (m *inlineMailbox) UserMessageCount() int {
	m.mu.Lock()
	defer m.mu.Unlock()
	return len(m.user) - m.userHead
}

// run handles messages until none is runnable, then gives the mailbox up.
// A panic in a handler is escalated (which suspends the mailbox: only
// system messages run after it) and the loop goes on, as the default
// mailbox does.
func (m *inlineMailbox) run() {
	for !m.runUntilIdle() {
	}
}

// runUntilIdle reports false when a handler panicked (the mailbox is
// still marked running: the caller loops).
func (m *inlineMailbox) runUntilIdle() (idle bool) {
	var msg any
	defer func() {
		if r := recover(); r != nil {
			m.invoker.EscalateFailure(r, msg)
		}
	}()
	for n := 0; ; {
		var system, ok bool
		if msg, system, ok = m.next(); !ok {
			return true
		}
		if n++; n > inlineThroughput {
			n = 0
			runtime.Gosched()
		}
		if system {
			m.invoker.InvokeSystemMessage(msg)
		} else {
			m.invoker.InvokeUserMessage(msg)
		}
	}
}

// next takes the next runnable message, or marks the mailbox idle; under
// the lock, so a concurrent post either sees it running and queues, or
// sees it idle and runs it itself.
func (m *inlineMailbox) next() (msg any, system bool, ok bool) {
	m.mu.Lock()
	defer m.mu.Unlock()
	for len(m.system) > 0 {
		msg = m.system[0]
		m.system[0] = nil
		if m.system = m.system[1:]; len(m.system) == 0 {
			m.system = nil // rare: not worth keeping an array per actor
		}
		switch msg.(type) {
		case *actor.SuspendMailbox:
			m.suspended = true
		case *actor.ResumeMailbox:
			m.suspended = false
		default:
			return msg, true, true
		}
	}
	if m.suspended || m.userHead == len(m.user) {
		m.running = false
		return nil, false, false
	}
	msg = m.user[m.userHead]
	m.user[m.userHead] = nil
	switch m.userHead++; {
	case m.userHead == len(m.user):
		m.user, m.userHead = m.user[:0], 0 // drained: reuse the array
	case m.userHead >= 64 && m.userHead*2 >= len(m.user):
		// Never drained while posts keep coming: drop the taken half.
		n := copy(m.user, m.user[m.userHead:])
		clear(m.user[n:])
		m.user, m.userHead = m.user[:n], 0
	}
	return msg, false, true
}
