//! Generates `crates/stoke/src/ops/*.rs`: the impls of Burn's backend op traits for `Stoke<I>`.
//!
//! Every method of every op trait is forwarded to the inner backend `I`, including those with
//! default bodies (a default body is a composition of other ops and would bypass the inner
//! backend's own kernel). The trait definitions are read from the burn-backend source that cargo
//! resolved, so a Burn upgrade regenerates the forwarding instead of hand-editing 400 bodies.
//!
//! Types decide the conversions. `FloatTensor<Self>` is Stoke's own primitive
//! (`stoke::StokeTensor`): arguments are lowered to the inner primitive (materialized if Stoke owns
//! the data) and results lifted back. Int, bool and quantized primitives are the inner backend's
//! own types and pass through untouched. Structs that carry float tensors
//! (`MaxPool2dWithIndices<B>`, `TransactionPrimitive<B>`, ...) go through the `Lower`/`Lift`
//! impls written by hand in `crates/stoke/src/ops/convert.rs`.
//!
//! Usage: `cargo run -p stoke-forwardgen` writes the files; `-- --check` exits non-zero when
//! the committed files differ from what would be generated.

use proc_macro2::TokenStream;
use quote::{format_ident, quote};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};
use syn::visit_mut::VisitMut;
use syn::{FnArg, GenericArgument, Pat, PathArguments, ReturnType, TraitItem, Type};

/// (source file under burn-backend/src/backend/ops, trait, generated file, intercepted methods).
/// An intercepted method calls `crate::route::<name>` with Stoke's own arguments instead of
/// forwarding: that is where Stoke's kernels take over.
const TRAITS: &[(&str, &str, &str, &[&str])] = &[
    (
        "tensor.rs",
        "FloatTensorOps",
        "float.rs",
        &[
            "float_device",
            "float_is_require_grad",
            "float_set_require_grad",
            "float_into_data",
        ],
    ),
    ("int_tensor.rs", "IntTensorOps", "int.rs", &[]),
    ("bool_tensor.rs", "BoolTensorOps", "bool.rs", &[]),
    (
        "modules/base.rs",
        "ModuleOps",
        "module.rs",
        &["linear", "attention"],
    ),
    ("activation.rs", "ActivationOps", "activation.rs", &[]),
    ("qtensor.rs", "QTensorOps", "qtensor.rs", &[]),
    ("transaction.rs", "TransactionOps", "transaction.rs", &[]),
];

/// Structs generic over the backend that hold float tensors; converted by `Lower`/`Lift`.
const CONVERTED_STRUCTS: &[&str] = &[
    "Conv2dBackward",
    "DeformConv2dBackward",
    "Conv3dBackward",
    "MaxPool1dBackward",
    "MaxPool1dWithIndices",
    "MaxPool2dBackward",
    "MaxPool2dWithIndices",
    "InterpolateBackward",
    "TransactionPrimitive",
    "TensorPrimitive",
    "QuantizationParametersPrimitive",
];

fn main() -> ExitCode {
    let check = std::env::args().any(|a| a == "--check");
    let root = workspace_root();
    let backend_src = burn_backend_src(&root);
    let out_dir = root.join("crates/stoke/src/ops");
    let mut stale = Vec::new();
    for (file, trait_name, out_file, intercepted) in TRAITS {
        let path = backend_src.join("src/backend/ops").join(file);
        let text = std::fs::read_to_string(&path)
            .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
        let ast = syn::parse_file(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let item = ast
            .items
            .iter()
            .find_map(|i| match i {
                syn::Item::Trait(t) if t.ident == *trait_name => Some(t),
                _ => None,
            })
            .unwrap_or_else(|| panic!("trait {trait_name} not found in {}", path.display()));
        let code = generate(item, intercepted);
        let target = out_dir.join(out_file);
        if check {
            let current = std::fs::read_to_string(&target).unwrap_or_default();
            if current != code {
                stale.push(target.display().to_string());
            }
        } else {
            std::fs::write(&target, code).unwrap();
            println!("wrote {}", target.display());
        }
    }
    if !stale.is_empty() {
        eprintln!(
            "generated forwarding is stale (run `cargo run -p stoke-forwardgen`): {}",
            stale.join(", ")
        );
        return ExitCode::FAILURE;
    }
    ExitCode::SUCCESS
}

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .canonicalize()
        .unwrap()
}

/// The burn-backend source directory cargo resolved for this workspace.
fn burn_backend_src(root: &Path) -> PathBuf {
    let out = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
        .args(["metadata", "--format-version", "1"])
        .current_dir(root)
        .output()
        .expect("cargo metadata");
    assert!(out.status.success(), "cargo metadata failed");
    let meta: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let pkg = meta["packages"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["name"] == "burn-backend")
        .expect("burn-backend in cargo metadata");
    PathBuf::from(pkg["manifest_path"].as_str().unwrap())
        .parent()
        .unwrap()
        .to_path_buf()
}

/// Rewrites the trait's backend parameter `B` into `Self`, and burn-backend's `crate::` paths
/// into `burn_backend::`, in a signature.
struct BToSelf;
impl VisitMut for BToSelf {
    fn visit_path_mut(&mut self, path: &mut syn::Path) {
        if let Some(first) = path.segments.first_mut() {
            if first.ident == "B" && first.arguments.is_empty() {
                first.ident = format_ident!("Self");
            } else if first.ident == "crate" {
                first.ident = format_ident!("burn_backend");
            }
        }
        syn::visit_mut::visit_path_mut(self, path);
    }
}

fn generate(item: &syn::ItemTrait, intercepted: &[&str]) -> String {
    let trait_ident = &item.ident;
    let mut methods = Vec::new();
    for ti in &item.items {
        let TraitItem::Fn(f) = ti else { continue };
        let mut sig = f.sig.clone();
        BToSelf.visit_signature_mut(&mut sig);
        // Arguments may be patterns like `_x`; give every argument a plain name.
        let mut arg_names = Vec::new();
        for (idx, input) in sig.inputs.iter_mut().enumerate() {
            let FnArg::Typed(pt) = input else {
                panic!("{}: receiver", sig.ident)
            };
            let name = match &*pt.pat {
                Pat::Ident(pi) => pi.ident.to_string().trim_start_matches('_').to_string(),
                _ => format!("arg{idx}"),
            };
            let name = format_ident!(
                "{}",
                if name.is_empty() {
                    format!("arg{idx}")
                } else {
                    name
                }
            );
            *pt.pat = syn::parse_quote!(#name);
            arg_names.push((name, (*pt.ty).clone()));
        }
        let name = &sig.ident;
        let body = if intercepted.contains(&name.to_string().as_str()) {
            let args = arg_names.iter().map(|(n, _)| n);
            quote! { crate::route::#name::<I>(#(#args),*) }
        } else {
            let args = arg_names.iter().map(|(n, t)| lower(quote!(#n), t));
            let call = quote! { I::#name(#(#args),*) };
            let op = name.to_string();
            let forwarded = match &sig.output {
                ReturnType::Default => quote! { #call },
                ReturnType::Type(_, ty) => lift_return(call, ty),
            };
            // Every forwarded op reports itself: a strict graph capture fails on one (it runs on
            // the inner backend's stream, outside the graph).
            quote! { crate::route::inner_op(#op); #forwarded }
        };
        let attrs = f.attrs.iter().filter(|a| !a.path().is_ident("doc"));
        methods.push(quote! {
            #(#attrs)*
            #sig {
                #body
            }
        });
    }
    // Laid out by prettyplease; rustfmt leaves it so, so that `--check` and `cargo fmt` agree.
    let file: syn::File = syn::parse2(quote! {
        #[rustfmt::skip]
        impl<I: Backend> #trait_ident<Self> for Stoke<I> {
            #(#methods)*
        }
    })
    .expect("generated code parses");
    format!(
        "// @generated by stoke-forwardgen from burn-backend's `{trait_ident}`. Do not edit:\n\
         // run `cargo run -p stoke-forwardgen` after changing the generator or upgrading Burn.\n\
         #![allow(unused_imports, clippy::all)]\n\
         use super::prelude::*;\n\n{}",
        prettyplease::unparse(&file)
    )
}

/// What a type holds, as far as conversion is concerned.
enum Kind {
    /// No float tensor inside: passes through unchanged.
    Plain,
    /// `FloatTensor<Self>`.
    Float,
    /// A struct listed in `CONVERTED_STRUCTS`, generic over `Self`.
    Struct,
    Vec(Box<Type>),
    Option(Box<Type>),
    Tuple(Vec<Type>),
    Ref(Box<Type>),
}

fn generic_args(seg: &syn::PathSegment) -> Vec<Type> {
    match &seg.arguments {
        PathArguments::AngleBracketed(a) => a
            .args
            .iter()
            .filter_map(|g| match g {
                GenericArgument::Type(t) => Some(t.clone()),
                _ => None,
            })
            .collect(),
        _ => vec![],
    }
}

fn is_self(t: &Type) -> bool {
    matches!(t, Type::Path(p) if p.qself.is_none() && p.path.is_ident("Self"))
}

fn kind(t: &Type) -> Kind {
    match t {
        Type::Reference(r) => {
            if needs_conversion(&r.elem) {
                Kind::Ref(r.elem.clone())
            } else {
                Kind::Plain
            }
        }
        Type::Tuple(tt) => {
            let elems: Vec<Type> = tt.elems.iter().cloned().collect();
            if elems.iter().any(needs_conversion) {
                Kind::Tuple(elems)
            } else {
                Kind::Plain
            }
        }
        Type::Paren(p) => kind(&p.elem),
        Type::Path(p) if p.qself.is_none() => {
            let seg = p.path.segments.last().unwrap();
            let args = generic_args(seg);
            let ident = seg.ident.to_string();
            match ident.as_str() {
                "FloatTensor" if args.len() == 1 && is_self(&args[0]) => Kind::Float,
                "Vec" if needs_conversion(&args[0]) => Kind::Vec(Box::new(args[0].clone())),
                "Option" if needs_conversion(&args[0]) => Kind::Option(Box::new(args[0].clone())),
                s if CONVERTED_STRUCTS.contains(&s) && args.iter().any(is_self) => Kind::Struct,
                _ => {
                    if args.iter().any(needs_conversion) {
                        panic!("no conversion for type `{}`", quote!(#t));
                    }
                    Kind::Plain
                }
            }
        }
        _ => Kind::Plain,
    }
}

fn needs_conversion(t: &Type) -> bool {
    !matches!(kind(t), Kind::Plain)
}

/// Expression converting `e` (of Stoke-side type `t`) to the inner backend's type.
fn lower(e: TokenStream, t: &Type) -> TokenStream {
    match kind(t) {
        Kind::Plain => e,
        Kind::Float => quote! { lower_float::<I>(#e) },
        Kind::Struct => quote! { Lower::<I>::lower(#e) },
        Kind::Vec(inner) => {
            let x = lower(quote!(x), &inner);
            quote! { #e.into_iter().map(|x| #x).collect::<Vec<_>>() }
        }
        Kind::Option(inner) => {
            let x = lower(quote!(x), &inner);
            quote! { #e.map(|x| #x) }
        }
        Kind::Tuple(elems) => {
            let names: Vec<_> = (0..elems.len()).map(|i| format_ident!("t{i}")).collect();
            let conv = names.iter().zip(&elems).map(|(n, t)| lower(quote!(#n), t));
            quote! { { let (#(#names),*) = #e; (#(#conv),*) } }
        }
        // A borrowed float tensor: materialize a (cheap, handle-cloning) owned copy and borrow it.
        Kind::Ref(inner) => {
            let owned = lower(quote! { ::core::clone::Clone::clone(#e) }, &inner);
            quote! { &#owned }
        }
    }
}

/// Expression converting `e` (inner backend's type) to Stoke's type `t`.
fn lift(e: TokenStream, t: &Type) -> TokenStream {
    match kind(t) {
        Kind::Plain => e,
        Kind::Float => quote! { lift_float::<I>(#e) },
        Kind::Struct => quote! { Lift::<I>::lift(#e) },
        Kind::Vec(inner) => {
            let x = lift(quote!(x), &inner);
            quote! { #e.into_iter().map(|x| #x).collect::<Vec<_>>() }
        }
        Kind::Option(inner) => {
            let x = lift(quote!(x), &inner);
            quote! { #e.map(|x| #x) }
        }
        Kind::Tuple(elems) => {
            let names: Vec<_> = (0..elems.len()).map(|i| format_ident!("t{i}")).collect();
            let conv = names.iter().zip(&elems).map(|(n, t)| lift(quote!(#n), t));
            quote! { { let (#(#names),*) = #e; (#(#conv),*) } }
        }
        Kind::Ref(_) => panic!("cannot return a borrowed float tensor"),
    }
}

/// Lifts a call's result, looking through `impl Future<Output = T>` and `Result<T, E>`.
fn lift_return(call: TokenStream, ty: &Type) -> TokenStream {
    if let Type::ImplTrait(it) = ty {
        let output = it.bounds.iter().find_map(|b| match b {
            syn::TypeParamBound::Trait(tb) => {
                let seg = tb.path.segments.last()?;
                if seg.ident != "Future" {
                    return None;
                }
                match &seg.arguments {
                    PathArguments::AngleBracketed(a) => a.args.iter().find_map(|g| match g {
                        GenericArgument::AssocType(at) if at.ident == "Output" => {
                            Some(at.ty.clone())
                        }
                        _ => None,
                    }),
                    _ => None,
                }
            }
            _ => None,
        });
        let output = output.unwrap_or_else(|| panic!("unsupported impl Trait `{}`", quote!(#ty)));
        if !needs_conversion(&output) {
            return call;
        }
        let lifted = lift_result(quote!(out), &output);
        return quote! {
            let fut = #call;
            async move { let out = fut.await; #lifted }
        };
    }
    lift_result(call, ty)
}

fn lift_result(e: TokenStream, ty: &Type) -> TokenStream {
    if let Type::Path(p) = ty {
        let seg = p.path.segments.last().unwrap();
        if seg.ident == "Result" {
            let ok = &generic_args(seg)[0];
            if needs_conversion(ok) {
                let x = lift(quote!(x), ok);
                return quote! { #e.map(|x| #x) };
            }
            return e;
        }
    }
    lift(e, ty)
}
