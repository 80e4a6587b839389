package actors

// Signal is a one-shot notice a message carries back to whoever sent it (a
// batch handled, a request's part of a step applied). It is an interface,
// not a func, so a sender can pass an object it already has: a method value
// (credit.Return, heldEvents.release) cost a heap allocation per message.
type Signal interface{ Signal() }

// SignalFunc adapts a func to a Signal; a func value is pointer-shaped, so
// the conversion allocates nothing.
type SignalFunc func()

// Signal calls f.
func (f SignalFunc) Signal() { f() }
