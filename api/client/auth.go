package client

import (
	"bytes"
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"os/exec"
	"strings"
	"sync"
	"time"

	"golang.org/x/oauth2"
	"google.golang.org/api/idtoken"
)

// Token is an identity token and when it expires.
type Token struct {
	Value string
	// Expiry is when the token stops being valid. Zero means: read the
	// token's own "exp" claim if it is a JWT; a token with neither is
	// fetched anew for every call.
	Expiry time.Time
}

// TokenSource gives identity tokens for the service's front end (Cloud
// Run's IAM). A Client caches what it gives until shortly before it
// expires, and concurrent calls share one fetch.
type TokenSource interface {
	Token(ctx context.Context) (Token, error)
}

// TokenFunc is a function as a TokenSource.
type TokenFunc func(ctx context.Context) (Token, error)

// Token calls f.
func (f TokenFunc) Token(ctx context.Context) (Token, error) { return f(ctx) }

// GcloudIdentity gives the identity token of the account gcloud is logged
// in as (`gcloud auth print-identity-token`): for a person or a program
// outside Google Cloud. It is the default for a service on *.run.app.
func GcloudIdentity() TokenSource { return gcloudSource{} }

type gcloudSource struct{}

func (gcloudSource) Token(ctx context.Context) (Token, error) {
	var stderr bytes.Buffer
	cmd := exec.CommandContext(ctx, "gcloud", "auth", "print-identity-token")
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		msg := strings.TrimSpace(stderr.String())
		if errors.Is(err, exec.ErrNotFound) {
			msg = "gcloud is not installed (or not on PATH)"
		}
		return Token{}, fmt.Errorf("gcloud auth print-identity-token: %v: %s (log in with 'gcloud auth login'; on Google Cloud, take the identity token from the metadata server instead)", err, msg)
	}
	tok := strings.TrimSpace(string(out))
	if tok == "" {
		return Token{}, errors.New("gcloud auth print-identity-token printed no token (log in with 'gcloud auth login')")
	}
	return Token{Value: tok}, nil
}

// MetadataIdentity gives identity tokens for audience from the metadata
// server of the Google Cloud machine the program runs on (its service
// account; google.golang.org/api/idtoken, which also takes a service
// account key named by GOOGLE_APPLICATION_CREDENTIALS). An empty audience
// is the service's URL, which is what Cloud Run expects.
func MetadataIdentity(audience string) TokenSource { return &metadataSource{audience: audience} }

type metadataSource struct {
	audience string

	mu  sync.Mutex
	src oauth2.TokenSource
}

func (m *metadataSource) withAudience(a string) TokenSource {
	if m.audience != "" {
		return m
	}
	return &metadataSource{audience: a}
}

func (m *metadataSource) Token(ctx context.Context) (Token, error) {
	if m.audience == "" {
		return Token{}, errors.New("metadata identity: no audience (give the service's URL)")
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.src == nil {
		ts, err := idtoken.NewTokenSource(ctx, m.audience)
		if err != nil {
			return Token{}, fmt.Errorf("identity token from the metadata server for %s: %w (off Google Cloud, take the identity token from gcloud instead)", m.audience, err)
		}
		m.src = ts
	}
	t, err := m.src.Token()
	if err != nil {
		return Token{}, fmt.Errorf("identity token from the metadata server for %s: %w", m.audience, err)
	}
	return Token{Value: t.AccessToken, Expiry: t.Expiry}, nil
}

// audienced is a TokenSource that learns the service's URL from New.
type audienced interface{ withAudience(string) TokenSource }

// tokenCache keeps a source's token until shortly before it expires; the
// calls that need a token while one is being fetched share that fetch.
type tokenCache struct {
	src TokenSource
	now func() time.Time

	mu       sync.Mutex
	tok      Token
	fetching *tokenFetch
}

type tokenFetch struct {
	done chan struct{}
	tok  Token
	err  error
}

// refreshMargin is how long before its expiry a token is replaced.
const refreshMargin = time.Minute

// fetchTimeout bounds one fetch, whoever waits for it.
const fetchTimeout = time.Minute

func (c *tokenCache) valid(t Token) bool {
	return t.Value != "" && !t.Expiry.IsZero() && c.now().Before(t.Expiry.Add(-refreshMargin))
}

// token returns a valid token, fetching one if needed.
func (c *tokenCache) token(ctx context.Context) (string, error) {
	c.mu.Lock()
	if c.valid(c.tok) {
		defer c.mu.Unlock()
		return c.tok.Value, nil
	}
	f := c.fetching
	if f == nil {
		f = &tokenFetch{done: make(chan struct{})}
		c.fetching = f
		// Detached from the caller: others may be waiting for it.
		fctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), fetchTimeout)
		go func() {
			defer cancel()
			t, err := c.src.Token(fctx)
			if err == nil && t.Value == "" {
				err = errors.New("the identity source gave an empty token")
			}
			if err == nil && t.Expiry.IsZero() {
				t.Expiry = jwtExpiry(t.Value)
			}
			c.mu.Lock()
			f.tok, f.err = t, err
			if err == nil {
				c.tok = t
			}
			c.fetching = nil
			c.mu.Unlock()
			close(f.done)
		}()
	}
	c.mu.Unlock()
	select {
	case <-f.done:
		return f.tok.Value, f.err
	case <-ctx.Done():
		return "", context.Cause(ctx)
	}
}

// invalidate drops the cached token: the front end refused it.
func (c *tokenCache) invalidate() {
	c.mu.Lock()
	c.tok = Token{}
	c.mu.Unlock()
}

// jwtExpiry reads the "exp" claim of a JWT, without verifying anything
// (the token is ours to send, not to trust); zero if there is none.
func jwtExpiry(tok string) time.Time {
	parts := strings.Split(tok, ".")
	if len(parts) != 3 {
		return time.Time{}
	}
	b, err := base64.RawURLEncoding.DecodeString(parts[1])
	if err != nil {
		return time.Time{}
	}
	var claims struct {
		Exp json.Number `json:"exp"`
	}
	if json.Unmarshal(b, &claims) != nil {
		return time.Time{}
	}
	n, err := claims.Exp.Int64()
	if err != nil || n <= 0 {
		return time.Time{}
	}
	return time.Unix(n, 0)
}
