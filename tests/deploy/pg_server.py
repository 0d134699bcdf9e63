"""A throwaway PostgreSQL server from Debian's package (`apt-get install postgresql`, `make postgres-deps`) for the
deployment tests: initdb into a temporary directory, `pg_ctl start` on 127.0.0.1 at a free port with its unix socket
in that directory, password authentication over TCP (scram-sha-256), stopped and removed by `close()`.

PostgreSQL refuses to run as root: as root the server runs as the `postgres` user (or `nobody`), and its directory
lives under /tmp (pytest's tmp_path is under a root-only directory that user cannot enter)."""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path


def pg_bin() -> Path | None:
    """The newest installed server's binaries (/usr/lib/postgresql/<major>/bin), else initdb on PATH."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(Path(p).parts[-3]))
    if found:
        return Path(found[-1]).parent
    initdb = shutil.which("initdb")
    return Path(initdb).parent if initdb else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PgServer:
    user = "temper"  # the database superuser initdb creates

    def __init__(self, bin_dir: Path):
        self.bin = bin_dir
        self.password = os.urandom(12).hex()
        self.dir = Path(tempfile.mkdtemp(prefix="temper-pg-"))
        self.data, self.sock, self.log = self.dir / "data", self.dir / "sock", self.dir / "server.log"
        self.sock.mkdir()
        (self.dir / "pw").write_text(self.password + "\n")
        self.run_as = None
        if os.geteuid() == 0:
            try:
                self.run_as = pwd.getpwnam("postgres")
            except KeyError:
                self.run_as = pwd.getpwnam("nobody")
            for p in (self.dir, self.sock, self.dir / "pw"):
                os.chown(p, self.run_as.pw_uid, self.run_as.pw_gid)
        self.port = 0

    def _run(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        kw = {}
        if self.run_as is not None:
            kw = {"user": self.run_as.pw_uid, "group": self.run_as.pw_gid, "extra_groups": []}
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LC_ALL": "C", "TZ": "UTC",
               "HOME": str(self.dir)}
        r = subprocess.run([str(self.bin / args[0]), *args[1:]], capture_output=True, text=True, timeout=timeout,
                           cwd=self.dir, env=env, **kw)
        if r.returncode != 0:
            log = self.log.read_text()[-3000:] if self.log.exists() else ""
            raise RuntimeError(f"{args[0]} failed ({r.returncode}):\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}\n{log}")
        return r

    def start(self) -> PgServer:
        self._run("initdb", "-D", str(self.data), "-U", self.user, "--pwfile", str(self.dir / "pw"), "-E", "UTF8",
                  "--no-locale", "--auth-local=scram-sha-256", "--auth-host=scram-sha-256", "--no-sync")
        opts = (f"-h 127.0.0.1 -k {self.sock} -c fsync=off -c synchronous_commit=off -c full_page_writes=off "
                "-c max_connections=200")
        for _ in range(3):  # the port was free a moment ago; another process may take it first
            self.port = _free_port()
            try:
                self._run("pg_ctl", "-D", str(self.data), "-l", str(self.log), "-w", "-t", "60",
                          "-o", f"{opts} -p {self.port}", "start")
                return self
            except RuntimeError:
                if "could not bind" not in (self.log.read_text() if self.log.exists() else ""):
                    raise
        raise RuntimeError(f"postgres could not bind a port: {self.log.read_text()[-2000:]}")

    def url(self, db: str) -> str:
        """A SQLAlchemy URL with psycopg2 (dagster-postgres's driver) and without the password (libpq reads it from
        $PGPASSWORD, as the deployment docs advise)."""
        return f"postgresql+psycopg2://{self.user}@127.0.0.1:{self.port}/{db}"

    def connect(self, db: str = "postgres"):
        import psycopg2

        conn = psycopg2.connect(host="127.0.0.1", port=self.port, user=self.user, password=self.password, dbname=db)
        conn.autocommit = True
        return conn

    def create_database(self, name: str) -> None:
        conn = self.connect()
        try:
            with conn.cursor() as cur:
                cur.execute(f'CREATE DATABASE "{name}"')
        finally:
            conn.close()

    def query(self, db: str, sql: str, args: tuple = ()) -> list[tuple]:
        conn = self.connect(db)
        try:
            with conn.cursor() as cur:
                cur.execute(sql, args)
                return cur.fetchall()
        finally:
            conn.close()

    def pid(self) -> int | None:
        try:
            return int((self.data / "postmaster.pid").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None

    def close(self) -> None:
        """Stop the server (fast shutdown: open client connections are ended) and remove its directory."""
        pid = self.pid()
        if pid is not None:
            try:
                self._run("pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "-t", "60", "stop")
            except (RuntimeError, subprocess.TimeoutExpired):
                try:  # the postmaster this server started, by its pid
                    os.kill(pid, signal.SIGQUIT)
                    time.sleep(1)
                except ProcessLookupError:
                    pass
        shutil.rmtree(self.dir, ignore_errors=True)
