package natsauth

import (
	"crypto/x509"
	"errors"
	"fmt"

	"github.com/nats-io/jwt/v2"
	"github.com/nats-io/nkeys"
)

// CheckCreds says whether data holds what a NATS credentials file must: a
// user JWT and an nkey seed. nats.go reads the file only as it dials, so a
// program checks it at start with this, where a bad file is a flag error.
func CheckCreds(data []byte) error {
	// ParseDecoratedJWT returns the whole file when it finds no JWT block,
	// never an error: the claims decide.
	token, err := nkeys.ParseDecoratedJWT(data)
	if err == nil {
		_, err = jwt.DecodeUserClaims(token)
	}
	if err != nil {
		return fmt.Errorf("no user JWT in it: %w", err)
	}
	if _, err := nkeys.ParseDecoratedNKey(data); err != nil {
		return fmt.Errorf("no nkey seed in it: %w", err)
	}
	return nil
}

// CheckCA says whether data holds a PEM certificate, as a CA file for
// nats.go's RootCAs must.
func CheckCA(data []byte) error {
	if !x509.NewCertPool().AppendCertsFromPEM(data) {
		return errors.New("no PEM certificate in it")
	}
	return nil
}
