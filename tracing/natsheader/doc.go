// Package natsheader carries W3C trace context in NATS message headers: the
// carrier the node's tracing package and the engine SDK (client/) share.
// It imports only nats.go and the OTel API, so an engine built on the SDK
// does not link the node's OTel SDK and exporters.
package natsheader
