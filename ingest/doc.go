// Package ingest turns raw NATS message bodies and subjects into checked
// messages values: DecodeBatch for P.E.events, DecodeSpec for P.E.register,
// DecodeLookup and DecodeLoad for the request/reply bodies, and ParseSubject
// for the subjects themselves (docs/PROTOCOL.md, shared/PROTOCOL.md). One
// decoder runs on the other side: DecodeStored reads P.E.stored for the
// engine SDK (package client), with the same hand-written reader.
//
// The package is pure: no actors, no NATS connection, no clock, no globals.
// Everything a caller may tune is in Limits. Each input is decoded and checked
// once here, at the edge, so that the engine and request actors can trust the
// values they receive (STYLE.md: "decode and validate each batch once").
//
// Event batches are on the hot path (the service targets 500k events/s on two
// cores), so DecodeBatch does not use encoding/json: it reads the body with a
// small hand-written JSON reader (lexer.go) that decodes each event exactly
// once into the flat messages.Event, without reflection, maps or a second
// pass. The reader still accepts exactly RFC 8259 JSON: a syntax error
// anywhere rejects the whole batch (as encoding/json would), while a
// well-formed event with a bad value rejects only that event.
//
// Choices where the protocol is silent (docs/ should state them too):
//
//   - Envelope fields epoch, seq and events are required; a missing or null
//     one rejects the batch. Inside an event only "type" and "request" are
//     required: other absent (or null) fields take their zero value, as with
//     encoding/json, so an engine whose encoder omits zero values (Go's
//     omitempty) still works. max_offload_tokens absent or null means unset.
//   - Object keys match exactly (case-sensitive, like encoding/json/v2);
//     a differently cased key is an unknown field and is ignored. Of
//     duplicate keys the last wins.
//   - Every known field that is present is checked, whatever the event type
//     uses (one wire shape for all types, since "type" may come last): a
//     wrong JSON type, a negative count, an id outside uint32, a group at or
//     over MaxGroups or a bad hash rejects the event. Fields the type does
//     not use are then dropped, so a decoded Event holds only its own.
//   - seq must be an integer in [0, 2^63), without a minus sign (not even
//     "-0", which encoding/json refuses for a uint64 such as the
//     heartbeat's seq).
//   - Request ids and the epoch must be valid UTF-8 after unescaping; a lone
//     surrogate escape (\ud800) is not, so it is rejected rather than
//     replaced by U+FFFD (two distinct ids must never collapse into one).
//     The encoding/json decoders hold to this too, where encoding/json
//     itself would replace: a load's request id, a heartbeat's epoch and a
//     spec's namespace.
//   - Rejected events are reported one EventError each, with a message,
//     for the first DetailedEventErrors (16) of a batch only; the rest are
//     counted in one EventError per reason (Count events, a static Err), and
//     nothing is formatted for them, so a body of junk events costs no
//     memory per event. Sum the Counts, not the entries, to count rejected
//     events.
package ingest
