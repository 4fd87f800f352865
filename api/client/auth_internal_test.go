package client

import (
	"context"
	"encoding/base64"
	"fmt"
	"sync"
	"testing"
	"time"
)

// A cached token is replaced a minute before it expires, by the cache's
// clock: the test moves the clock, not the wall.
func TestTokenCacheExpiry(t *testing.T) {
	var mu sync.Mutex
	now := time.Date(2025, 3, 1, 12, 0, 0, 0, time.UTC)
	fetches := 0
	c := &tokenCache{
		src: TokenFunc(func(context.Context) (Token, error) {
			mu.Lock()
			defer mu.Unlock()
			fetches++
			return Token{Value: fmt.Sprintf("tok-%d", fetches), Expiry: now.Add(10 * time.Minute)}, nil
		}),
		now: func() time.Time { mu.Lock(); defer mu.Unlock(); return now },
	}
	ctx := context.Background()
	advance := func(d time.Duration) { mu.Lock(); now = now.Add(d); mu.Unlock() }
	for _, step := range []struct {
		advance time.Duration
		want    string
	}{
		{0, "tok-1"},
		{5 * time.Minute, "tok-1"},                // 5 min left
		{3*time.Minute + 59*time.Second, "tok-1"}, // 61 s left
		{2 * time.Second, "tok-2"},                // 59 s left: replaced
		{8*time.Minute + 59*time.Second, "tok-2"}, // 61 s left of tok-2: still
		{2 * time.Second, "tok-3"},                // 59 s
		{time.Hour, "tok-4"},                      // long expired
	} {
		advance(step.advance)
		got, err := c.token(ctx)
		if err != nil || got != step.want {
			t.Fatalf("after %v: %q %v, want %q", step.advance, got, err, step.want)
		}
	}
	c.invalidate()
	if got, _ := c.token(ctx); got != "tok-5" {
		t.Errorf("after invalidate: %q", got)
	}
}

// A token without an expiry is read for its JWT "exp"; without either it
// is fetched every time.
func TestTokenCacheJWT(t *testing.T) {
	enc := base64.RawURLEncoding.EncodeToString
	exp := time.Date(2030, 1, 1, 0, 0, 0, 0, time.UTC)
	jwtTok := enc([]byte(`{"alg":"RS256"}`)) + "." + enc([]byte(fmt.Sprintf(`{"aud":"a","exp":%d}`, exp.Unix()))) + ".c2ln"
	if got := jwtExpiry(jwtTok); !got.Equal(exp) {
		t.Errorf("jwtExpiry = %v, want %v", got, exp)
	}
	for _, bad := range []string{"opaque", "a.b.c", enc([]byte("{}")) + "." + enc([]byte(`{"exp":"soon"}`)) + ".x"} {
		if got := jwtExpiry(bad); !got.IsZero() {
			t.Errorf("jwtExpiry(%q) = %v, want zero", bad, got)
		}
	}
	n := 0
	c := &tokenCache{src: TokenFunc(func(context.Context) (Token, error) { n++; return Token{Value: "opaque"}, nil }), now: time.Now}
	c.token(context.Background())
	c.token(context.Background())
	if n != 2 {
		t.Errorf("an opaque token without expiry was fetched %d times for 2 calls, want 2", n)
	}
	m := 0
	c = &tokenCache{src: TokenFunc(func(context.Context) (Token, error) { m++; return Token{Value: jwtTok}, nil }), now: time.Now}
	c.token(context.Background())
	c.token(context.Background())
	if m != 1 {
		t.Errorf("a JWT valid until 2030 was fetched %d times, want 1", m)
	}
}

// A caller whose context ends stops waiting; the fetch goes on for the
// others.
func TestTokenCacheCallerGivesUp(t *testing.T) {
	release := make(chan struct{})
	c := &tokenCache{src: TokenFunc(func(ctx context.Context) (Token, error) {
		<-release
		return Token{Value: "late", Expiry: time.Now().Add(time.Hour)}, nil
	}), now: time.Now}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if _, err := c.token(ctx); err == nil {
		t.Error("a cancelled caller got a token")
	}
	close(release)
	if got, err := c.token(context.Background()); err != nil || got != "late" {
		t.Errorf("the next caller: %q %v", got, err)
	}
}
