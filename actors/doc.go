// Package actors holds the plumbing the kvactors actors share: the Outbox
// that publishes what kvactors tells engines and routers (with trace context
// in the NATS headers), the supervision strategy every parent sets
// explicitly, the labels of rejected inputs, and Observe, a receiver
// middleware that lets a test see every message an actor receives. Each
// subpackage (engine, request, transfer, load) is a thin shell around one
// pure value: it hands messages to that value and performs the effects that
// come back.
//
// There is no generic tracing middleware: a span per mailbox message would
// trace the plumbing, not the work. Spans are started where the protocol's
// units of work are (a batch, a request's lifetime, a store job, a copy, a
// load), and their contexts travel inside messages, never in a map keyed by
// PID.
package actors
