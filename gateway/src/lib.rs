//! sluice's gateway: an OpenAI front door that tokenizes once, admits and
//! routes each request through Wasm policy plugins, and relays it to a fleet
//! of workers. Modules follow the request's path: `api` (HTTP, auth) ->
//! `preprocess` -> `admission` -> `routing` (fleet, KV index) -> `upstream`;
//! beside it `admin`, `telemetry`, and the plugin host (`plugins`) behind the
//! policy contract (`policy`). `bench` holds `sluice bench`.

pub mod admin;
pub mod admission;
pub mod api;
pub mod bench;
pub mod config;
mod gateway;
pub mod plugins;
pub mod policy;
pub mod preprocess;
pub mod routing;
pub mod telemetry;
pub mod upstream;

pub use config::Config;
pub use gateway::{Gateway, Policies, Running, StartError, error_chain};
