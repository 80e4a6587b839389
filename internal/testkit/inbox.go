package testkit

import (
	"fmt"
	"strings"
	"time"

	"github.com/nats-io/nats.go"
)

// EngineInbox is a fresh reply inbox of engine's: under `_INBOX.<engine>.`,
// the only inbox the node answers an engine's verbs on (PROTOCOL.md
// "kvactors' choice, replies"; client.InboxPrefix). A connection shared by
// several test engines uses it to request as each of them.
func EngineInbox(engine string) string {
	return "_INBOX." + engine + "." + strings.TrimPrefix(nats.NewInbox(), "_INBOX.")
}

// EngineRequest is nc.Request as engine sends it: its reply on an
// EngineInbox of engine's, waited for at most timeout.
func EngineRequest(nc *nats.Conn, engine, subject string, data []byte, timeout time.Duration) (*nats.Msg, error) {
	inbox := EngineInbox(engine)
	sub, err := nc.SubscribeSync(inbox)
	if err != nil {
		return nil, fmt.Errorf("subscribe %s: %w", inbox, err)
	}
	defer func() { _ = sub.Unsubscribe() }()
	if err := nc.PublishRequest(subject, inbox, data); err != nil {
		return nil, fmt.Errorf("request %s: %w", subject, err)
	}
	m, err := sub.NextMsg(timeout)
	if err != nil {
		return nil, fmt.Errorf("request %s: no reply within %v: %w", subject, timeout, err)
	}
	return m, nil
}
