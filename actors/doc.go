// Package actors holds the plumbing the kvactors actors share: the Outbox
// that publishes what kvactors tells engines and routers, the supervision
// strategies every parent sets explicitly, and the receive middleware
// (counting panics, a test observer). Each subpackage (engine, request,
// transfer) is a thin shell around one pure value: it hands messages to that
// value and performs the effects that come back.
package actors
