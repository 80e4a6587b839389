// Package natsauth writes the NATS server configuration that isolates
// engines from each other (PROTOCOL.md "Isolation", docs/SECURITY.md): one
// user per engine, which may publish only on P.<id>.> and subscribe only to
// P.<id>.>, the node hellos and heartbeats and its own reply inboxes
// (_INBOX.<id>.>); one user for kvactors, the only one that may subscribe to
// the verbs it serves and to P._node.>, publish replies, and (when JetStream
// is on) use the JetStream API. `kvactors nats-config` prints it; `kvactors
// serve --nats-config` loads it into the embedded server.
package natsauth
