//! The export macros of `sluice-plugin-sdk`: each turns a type that implements one
//! of the SDK's policy traits into the exports of a Wasm component. Use them through
//! `sluice_plugin_sdk::{export_router, export_admission, export_cache_policy}`.
//!
//! They are procedural macros only so that the path of the WIT contract can be fixed
//! when this crate is compiled: the bindings of the plugin's world are generated in
//! the plugin crate (one world per component), while the shared types and host
//! imports come from the SDK through wit-bindgen's `with`.

use proc_macro::TokenStream;

/// The `wit/` folder of the sluice repository, fixed at this crate's compile time.
const WIT_DIR: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../../wit");

/// One plugin kind: its WIT world and interface, and the SDK glue for each export.
struct Kind {
    world: &'static str,
    interface: &'static str,
    /// `fn name(args) -> ret { glue }` items of the interface's `Guest` impl;
    /// `STATE` is the plugin's instance and `Policy` its type.
    functions: &'static str,
}

const ROUTER: Kind = Kind {
    world: "router-plugin",
    interface: "router",
    functions: r#"
        fn init(config: String) -> Result<(), String> {
            STATE.with(|s| ::sluice_plugin_sdk::__private::init(s, &config, <Policy as ::sluice_plugin_sdk::Router>::configure))
        }
        fn route(request: ::sluice_plugin_sdk::RequestView, fleet: ::sluice_plugin_sdk::FleetView)
            -> ::sluice_plugin_sdk::RouteDecision {
            STATE.with(|s| ::sluice_plugin_sdk::__private::with_policy::<Policy, _>(s, |p| {
                ::sluice_plugin_sdk::Router::route(p, &request, &fleet)
            }))
        }
    "#,
};

const ADMISSION: Kind = Kind {
    world: "admission-plugin",
    interface: "admission",
    functions: r#"
        fn init(config: String) -> Result<(), String> {
            STATE.with(|s| ::sluice_plugin_sdk::__private::init(s, &config, <Policy as ::sluice_plugin_sdk::Admission>::configure))
        }
        fn admit(request: ::sluice_plugin_sdk::RequestView, saturation: ::sluice_plugin_sdk::FleetSaturation)
            -> ::sluice_plugin_sdk::AdmitDecision {
            STATE.with(|s| ::sluice_plugin_sdk::__private::with_policy::<Policy, _>(s, |p| {
                ::sluice_plugin_sdk::Admission::admit(p, &request, &saturation)
            }))
        }
        fn on_complete(done: ::sluice_plugin_sdk::Completion) {
            STATE.with(|s| ::sluice_plugin_sdk::__private::with_policy::<Policy, _>(s, |p| {
                ::sluice_plugin_sdk::Admission::on_complete(p, &done)
            }))
        }
    "#,
};

const CACHE_POLICY: Kind = Kind {
    world: "cache-policy-plugin",
    interface: "cache_policy",
    functions: r#"
        fn init(config: String) -> Result<(), String> {
            STATE.with(|s| ::sluice_plugin_sdk::__private::init(s, &config, <Policy as ::sluice_plugin_sdk::CachePolicy>::configure))
        }
        fn hints(request: ::sluice_plugin_sdk::RequestView) -> ::sluice_plugin_sdk::CacheHints {
            STATE.with(|s| ::sluice_plugin_sdk::__private::with_policy::<Policy, _>(s, |p| {
                ::sluice_plugin_sdk::CachePolicy::hints(p, &request)
            }))
        }
        fn score_eviction(candidates: ::sluice_plugin_sdk::EvictionCandidates) -> Vec<f32> {
            STATE.with(|s| ::sluice_plugin_sdk::__private::with_policy::<Policy, _>(s, |p| {
                ::sluice_plugin_sdk::CachePolicy::score_eviction(p, &candidates)
            }))
        }
    "#,
};

fn expand(kind: &Kind, input: TokenStream) -> TokenStream {
    let policy = input.to_string();
    if policy.trim().is_empty() {
        return r#"compile_error!("name the policy type: export_xxx!(MyPolicy)");"#
            .parse()
            .expect("valid tokens");
    }
    let Kind {
        world,
        interface,
        functions,
    } = kind;
    format!(
        r#"
        // Exports exist only in the Wasm build: a native build (unit tests under
        // `sluice_plugin_sdk::testing`) has nothing to export to.
        #[cfg(target_family = "wasm")]
        #[doc(hidden)]
        type __SluiceExportedPolicy = {policy};

        #[cfg(target_family = "wasm")]
        #[doc(hidden)]
        #[allow(clippy::all, unsafe_op_in_unsafe_fn)]
        mod __sluice_export {{
            ::sluice_plugin_sdk::__private::wit_bindgen::generate!({{
                path: {WIT_DIR:?},
                world: "sluice:policy/{world}",
                runtime_path: "::sluice_plugin_sdk::__private::wit_bindgen::rt",
                with: {{
                    "sluice:policy/types@0.1.1": ::sluice_plugin_sdk::types,
                    "sluice:policy/host@0.1.1": ::sluice_plugin_sdk::__private::host,
                }},
            }});

            type Policy = super::__SluiceExportedPolicy;

            ::std::thread_local! {{
                static STATE: ::std::cell::RefCell<Option<Policy>> = const {{ ::std::cell::RefCell::new(None) }};
            }}

            struct Export;

            impl exports::sluice::policy::{interface}::Guest for Export {{
                {functions}
            }}

            export!(Export);
        }}
        "#
    )
    .parse()
    .expect("the export macro expands to valid tokens")
}

/// Exports a type implementing `sluice_plugin_sdk::Router` as the component's
/// `sluice:policy/router` interface.
#[proc_macro]
pub fn export_router(input: TokenStream) -> TokenStream {
    expand(&ROUTER, input)
}

/// Exports a type implementing `sluice_plugin_sdk::Admission` as the component's
/// `sluice:policy/admission` interface.
#[proc_macro]
pub fn export_admission(input: TokenStream) -> TokenStream {
    expand(&ADMISSION, input)
}

/// Exports a type implementing `sluice_plugin_sdk::CachePolicy` as the component's
/// `sluice:policy/cache-policy` interface.
#[proc_macro]
pub fn export_cache_policy(input: TokenStream) -> TokenStream {
    expand(&CACHE_POLICY, input)
}
