from django.contrib import messages
from django.shortcuts import redirect, render

from . import sms
from .booking import SeatTaken, book_seat
from .forms import BookingForm
from .models import Booking


def book(request):
    form = BookingForm(request.POST or None)
    if request.method == "POST" and form.is_valid():
        try:
            booking = book_seat(form.cleaned_data["seat"], form.cleaned_data["phone"])
        except SeatTaken as taken:
            form.add_error("seat", str(taken))
        else:
            messages.success(request, f"Seat {booking.seat} is booked; your SMS is on its way.")
            return redirect("cinema:bookings")
    return render(request, "cinema/book.html", {"form": form})


def bookings(request):
    booked = list(Booking.objects.all())
    states = sms.states_for(booked)
    rows = [(booking, states[booking.pk]) for booking in booked]
    return render(request, "cinema/bookings.html", {"rows": rows})
